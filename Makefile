.PHONY: protos check test lint
protos:
	python -m services.common.protogen
check:
	python -m services.common.protogen --check
lint:
	ruff check services tests bench
	mypy services
test:
	pytest
