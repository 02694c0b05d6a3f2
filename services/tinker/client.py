"""A small client of the Tinker API for fleetrl's own tools (`fleetrl top`): the caller's live sessions.

The official `tinker` SDK is the users' client; this one reads only what the SDK has no call for
(each session's summary beside `list_sessions`'s ids) and imports neither the SDK nor torch, so `fleetrl top`
starts at once. Plain `urllib` with a deadline on every call; the key is a tenant token (`X-API-Key`), so a
caller sees its own tenant's sessions only.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from fleetrl.errors import FleetError, PermissionDenied, Unauthenticated, Unavailable
from fleetrl.services.tinker.convert import session_summary
from fleetrl.tinker.types import SessionSummary

ENV_URL = "FLEETRL_TINKER_URL"


class TinkerClient:
    """The Tinker API at `url` (`http://host:port`, or `host:port`), as tenant `token`."""

    url: str
    token: str | None
    timeout_s: float

    def __init__(self, url: str, token: str | None, timeout_s: float = 10.0) -> None:
        self.url = url if "://" in url else f"http://{url}"
        self.token, self.timeout_s = token, timeout_s

    def sessions(self, limit: int = 100, all_tenants: bool = False) -> list[SessionSummary]:
        """The caller's live sessions, newest request first (`GET /api/v1/sessions`); every tenant's with
        `all_tenants` (an operator's key only: PermissionDenied otherwise)."""
        query = f"limit={limit}" + ("&all_tenants=true" if all_tenants else "")
        request = urllib.request.Request(f"{self.url}/api/v1/sessions?{query}", headers={"X-API-Key": self.token or ""})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body = json.load(response)
        except urllib.error.HTTPError as error:
            if error.code in (401, 403):
                kind = Unauthenticated if error.code == 401 else PermissionDenied
                raise kind(f"tinker API {self.url}: {error.read().decode(errors='replace')}") from None
            raise FleetError(f"tinker API {self.url}: HTTP {error.code}") from None
        except OSError as error:
            raise Unavailable(f"tinker API {self.url}: {error}") from None
        return [session_summary(item) for item in body["summaries"]]
