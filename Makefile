.PHONY: protos check test lint
protos:
	python -m fleetrl.runtime.protogen
check:
	python -m fleetrl.runtime.protogen --check
lint:
	ruff check fleetrl services tests bench
	mypy fleetrl
	lint-imports
test:
	pytest
