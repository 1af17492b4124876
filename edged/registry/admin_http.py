"""The operator's HTTP session with the registry API: one authenticated client, errors as RegistryClientError.

The operator client (:mod:`edged.registry.admin_client`) is this plus one module per job: publishing
(:mod:`.admin_releases`), the fleet (:mod:`.admin_fleet`), rollouts (:mod:`.admin_rollouts`) and access
(:mod:`.admin_access`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError

from edged.errors import EdgedError, ErrorCode, format_validation_error
from edged.protocol.fleet.messages import API_PREFIX
from edged.registry.access_wire import CLIENT_HEADER

if TYPE_CHECKING:
    import httpx

M = TypeVar("M", bound=BaseModel)
# When the registry's body has no code of ours (a proxy's page, Starlette's own 404/405): the status says.
STATUS_CODES = {400: ErrorCode.INVALID_ARGUMENT, 401: ErrorCode.UNAUTHENTICATED, 403: ErrorCode.PERMISSION_DENIED,
                404: ErrorCode.NOT_FOUND, 409: ErrorCode.FAILED_PRECONDITION, 413: ErrorCode.INVALID_ARGUMENT,
                422: ErrorCode.INVALID_ARGUMENT}


class RegistryClientError(EdgedError):
    def __init__(self, message: str, status: int = 0, code: ErrorCode = ErrorCode.UNAVAILABLE) -> None:
        super().__init__(message, code=code)
        self.status = status


def refusal_code(status: int, code: str) -> ErrorCode:
    """The registry's own code for a refusal (it maps each error once, server-side), else the status's."""
    try:
        return ErrorCode(code)
    except ValueError:
        return STATUS_CODES.get(status, ErrorCode.UNAVAILABLE)


def wire(model: type[M], **fields: Any) -> M:
    """A request body built here: a value the API would refuse (a bound, a name) is refused before sending,
    as the registry would word it (``ttl_s: ...``), as a typed error rather than pydantic's."""
    try:
        return model(**fields)
    except ValidationError as e:
        raise RegistryClientError("; ".join(format_validation_error(e)), code=ErrorCode.INVALID_ARGUMENT) from None


class AdminHttp:
    def __init__(self, url: str, token: str, *, timeout: float = 60.0, ca_file: Path | None = None,
                 client_cert: Path | None = None, client_key: Path | None = None, source: str | None = None) -> None:
        """``ca_file``: the CA bundle that signed an https registry's certificate (default: the system's);
        ``client_cert``/``client_key``: for a registry that requires client certificates; ``source``: "cli"
        when the ``edged-registry`` command calls (the audit log says so)."""
        import ssl

        import httpx

        self.url = url.rstrip("/")
        verify: ssl.SSLContext | bool = True
        if ca_file is not None or client_cert is not None:
            verify = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
            if client_cert is not None:
                verify.load_cert_chain(str(client_cert), str(client_key) if client_key else None)
        headers = {"Authorization": f"Bearer {token}", **({CLIENT_HEADER: source} if source else {})}
        self._http = httpx.Client(base_url=self.url, headers=headers,
                                  timeout=httpx.Timeout(timeout, connect=10.0), verify=verify)

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        import httpx

        try:
            r = self._http.request(method, API_PREFIX + path, **kw)
        except httpx.HTTPError as e:
            raise RegistryClientError(f"registry at {self.url} unreachable: {e}") from None
        if r.status_code >= 400:
            try:
                err = r.json()["error"]
                msg, code = err["message"], err["code"]
            except Exception:
                msg, code = r.text[:500], ""
            raise RegistryClientError(f"registry refused ({r.status_code} {code}): {msg}", r.status_code,
                                      refusal_code(r.status_code, str(code)))
        return r

    def _send(self, method: str, path: str, body: BaseModel) -> httpx.Response:
        """A request with a wire model as its JSON body."""
        return self._call(method, path, content=body.model_dump_json(), headers={"Content-Type": "application/json"})
