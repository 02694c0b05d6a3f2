"""Settings of the gateway (environment prefix FLEETRL_GATEWAY_).

Auth is closed by default: a gateway with no tokens and `open_mode = false` refuses to start, so
forgetting to configure tokens never exposes jobs. Tokens are stored as sha256 hex digests only
(`fleetrl gateway hash-token TOKEN` prints one).
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from services.common.config import InfraSettings, read_toml
from services.common.errors import ConfigError, FieldViolation

ENV_PREFIX = "FLEETRL_GATEWAY_"
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


class GatewaySettings(InfraSettings):
    """How one gateway process runs."""

    listen: str = "127.0.0.1:50051"
    """gRPC listen address host:port (port 0: a free port)."""
    reward_addr: str = "127.0.0.1:50053"
    """RewardService address; SubmitJob asks it to check every reward spec."""
    reward_validate_timeout_s: float = Field(15.0, gt=0, le=600)
    """Deadline of one RewardService.Validate call."""
    tokens: dict[str, str] = Field(default_factory=dict)
    """Tenant -> sha256 hex digest of its bearer token."""
    tokens_file: Path | None = None
    """TOML file of `tenant = "sha256 hex"` lines, merged into `tokens`."""
    open_mode: bool = False
    """No authentication: every caller is tenant `local`. For a single-user machine only."""
    tls_cert: Path | None = None
    """PEM certificate chain; with tls_key, the gateway serves TLS only."""
    tls_key: Path | None = None
    """PEM private key of tls_cert."""
    max_message_mb: float = Field(80.0, gt=0, le=2000)
    """Largest request gRPC accepts; larger ones are refused with RESOURCE_EXHAUSTED by gRPC itself."""
    max_prompts_mb: float = Field(64.0, gt=0, le=2000)
    """Largest prompt JSONL a submission may carry (RESOURCE_EXHAUSTED above)."""
    max_reward_file_kb: float = Field(1024.0, gt=0, le=1_000_000)
    """Largest reward file, and largest environment file, a submission may carry (RESOURCE_EXHAUSTED above)."""
    max_list_jobs: int = Field(1000, ge=1, le=100_000)
    """Cap on ListJobs' limit."""
    watch_poll_s: float = Field(0.25, gt=0, le=60)
    """How often a WatchJob stream re-reads the job and its steps."""
    download_chunk_kb: int = Field(1024, ge=1, le=32 * 1024)
    """Size of the FileChunks DownloadModel streams."""
    grace_s: float = Field(5.0, ge=0, le=600)
    """Seconds in-flight calls may finish after SIGTERM."""

    @field_validator("tokens")
    @classmethod
    def _hashes(cls, tokens: dict[str, str]) -> dict[str, str]:
        bad = [tenant for tenant, digest in tokens.items() if not _SHA256_HEX.match(digest)]
        if bad:
            raise ValueError(f"tokens of {', '.join(bad)} are not sha256 hex digests (use hash-token)")
        return tokens

    @model_validator(mode="after")
    def _tls_pair(self) -> GatewaySettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("set both tls_cert and tls_key, or neither")
        return self

    def token_table(self) -> dict[str, str]:
        """tokens merged with tokens_file; ConfigError if a digest is malformed."""
        table = dict(self.tokens)
        if self.tokens_file is not None:
            data = read_toml(self.tokens_file, "tokens_file")
            tokens = data.get("tokens", data)
            if not isinstance(tokens, dict):
                raise ConfigError("invalid tokens", [FieldViolation("tokens_file", f"{self.tokens_file}: "
                                                                   "[tokens] must be a table")])
            table.update(tokens)
        bad = [FieldViolation(f"tokens.{t}", "not a sha256 hex digest") for t, d in table.items()
               if not isinstance(d, str) or not _SHA256_HEX.match(d)]
        if bad:
            raise ConfigError("invalid tokens", bad)
        return table
