"""`UpstreamClient`: proxies OpenAI requests to the replicas of one upstream arm over httpx."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from types import TracebackType
from typing import Any, cast

import httpx
import structlog

import backends.upstream.errors as errors
from backends.upstream.config import UpstreamConfig
from backends.upstream.errors import UpstreamError
from backends.upstream.replicas import ReplicaPool, ReplicaState
from backends.upstream.sse import DONE_FRAME, SSEParseError, SSEParser

log = structlog.get_logger(__name__)

_DRAIN_AFTER_DONE_S = 1.0  # how long to wait for the upstream's EOF after [DONE]
# Errors before any response byte that mean "this replica did not take the request".
_REPLICA_FAILURES = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
)


class UpstreamClient:
    """A pooled httpx client for one upstream arm, with failover and health checks.

    Use as ``async with UpstreamClient(cfg) as client`` or call `start` / `close`.
    `transport` replaces httpx's network transport (then `max_connections` is the
    transport's business). Like the httpx client inside it, an instance belongs to the
    event loop that called `start`.
    """

    def __init__(
        self, config: UpstreamConfig, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.config = config
        self._transport = transport
        self._pool = ReplicaPool(config.base_urls)
        self._base_urls = [httpx.URL(url) for url in config.base_urls]
        self._http: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task[None] | None = None

    @property
    def replicas(self) -> list[ReplicaState]:
        """Snapshot of every replica's url, health, outstanding requests and failures."""
        return self._pool.snapshot()

    async def start(self) -> None:
        """Create the pooled connection and start the periodic health checks."""
        if self._http is not None:
            return
        cfg = self.config
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self._http = httpx.AsyncClient(
            transport=self._transport,
            headers=headers,
            limits=httpx.Limits(
                max_connections=cfg.max_connections,
                max_keepalive_connections=cfg.max_connections,
            ),
            timeout=httpx.Timeout(
                connect=cfg.connect_timeout_s,
                read=cfg.read_timeout_s,
                write=cfg.read_timeout_s,
                pool=cfg.connect_timeout_s,
            ),
        )
        if cfg.health_interval_s > 0:
            self._health_task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        """Stop the health checks and close every pooled connection."""
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def __aenter__(self) -> UpstreamClient:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def complete(
        self, path: str, body: dict[str, Any], headers: Mapping[str, str] | None = None
    ) -> tuple[int, dict[str, Any]]:
        """Non-streaming request: the upstream's 2xx status and JSON object.

        Raises `UpstreamError` for every failure. Cancelling the caller closes the
        upstream connection, so the upstream sees the disconnect.
        """
        index, response = await self._open(path, self._payload(body, stream=False), headers)
        try:
            content = await response.aread()
        except httpx.TimeoutException:
            raise errors.timeout(self._timeout_message()) from None
        except httpx.HTTPError as exc:
            self._pool.mark_down(index, type(exc).__name__)
            raise errors.bad_response("upstream closed the connection mid-response") from exc
        finally:
            self._pool.release(index)
            await response.aclose()
        try:
            data = json.loads(content)
        except (ValueError, UnicodeDecodeError):
            raise errors.bad_response("upstream returned a body that is not JSON") from None
        if not isinstance(data, dict):
            raise errors.bad_response("upstream returned JSON that is not an object")
        return response.status_code, data

    async def stream(
        self, path: str, body: dict[str, Any], headers: Mapping[str, str] | None = None
    ) -> AsyncIterator[bytes]:
        """Streaming request: yield each SSE event frame as soon as it arrives.

        Failures before the first event raise `UpstreamError` (before anything is
        yielded); later failures yield an in-band error event. The stream always ends with
        exactly one ``data: [DONE]``. ``aclose()`` (or cancellation) closes the upstream.
        """
        index, response = await self._open(path, self._payload(body, stream=True), headers)
        parser = SSEParser()
        started = False
        try:
            raw = cast(AsyncGenerator[bytes, None], response.aiter_bytes())
            async with contextlib.aclosing(raw) as chunks:
                try:
                    eof = False
                    while not eof:
                        chunk = await anext(chunks, None)
                        eof = chunk is None
                        for frame in parser.close() if chunk is None else parser.feed(chunk):
                            started = True
                            yield frame
                            if frame == DONE_FRAME:
                                await _drain(chunks)
                                return
                except (httpx.HTTPError, SSEParseError) as exc:
                    error = self._stream_error(index, exc)
                    if not started:
                        raise error from None
                    log.warning("upstream_stream_failed", code=error.code, reason=error.message)
                    yield error.to_sse()
                    yield DONE_FRAME
                    return
            if not started:
                raise errors.bad_response("upstream closed the stream without sending an event")
            yield DONE_FRAME  # NOTE: some servers (transformers serve) never send [DONE]
        finally:
            self._pool.release(index)
            await response.aclose()

    async def lookup(
        self,
        method: str,
        path: str,
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """A request without a body (GET or DELETE of a stored object): the JSON object of
        the first replica that does not answer 404.

        Each replica keeps its own objects (a Carousel's response store), so a 404 moves on
        to the next one; only when every replica answered 404 is that 404 raised. Any other
        error of a replica is raised at once (`UpstreamError`).
        """
        http = self._client()
        missing: UpstreamError | None = None
        for index in range(len(self._pool)):
            url = _join(self._base_urls[index], path)
            try:
                response = await http.request(
                    method, url, params=params, headers=_forwarded_headers(headers)
                )
            except httpx.HTTPError as exc:
                raise self._send_error(exc) from None
            if response.status_code == 404:
                missing = errors.error_from_client_error(404, response.content)
                continue
            if response.status_code >= 400:
                raise errors.error_from_client_error(response.status_code, response.content)
            try:
                data = response.json()
            except ValueError:
                raise errors.bad_response("upstream returned a body that is not JSON") from None
            if not isinstance(data, dict):
                raise errors.bad_response("upstream returned JSON that is not an object")
            return cast(dict[str, Any], data)
        assert missing is not None
        raise missing

    async def check_health(self) -> None:
        """Probe every replica once and update its health (the background task's step)."""
        results = await asyncio.gather(*(self._probe(i) for i in range(len(self._pool))))
        for index, healthy in enumerate(results):
            if healthy is True:
                self._pool.mark_up(index)
            elif healthy is False:
                self._pool.mark_down(index, "health check failed")

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self.check_health()
            except Exception as exc:  # NOTE: the loop must outlive any single bad round
                log.error("upstream_health_check_error", error=type(exc).__name__)

    async def _probe(self, index: int) -> bool | None:
        """Whether the replica is healthy: ``GET {base}/models`` answers 2xx, or, on a server
        without that route (404/405), ``GET {host}/health`` does. None means unknown: our
        own connection pool is exhausted, which says nothing about the replica."""
        http = self._client()
        base = self._base_urls[index]
        timeout = httpx.Timeout(self.config.connect_timeout_s)
        try:
            response = await http.get(_join(base, "/models"), timeout=timeout)
            if response.status_code in (404, 405):
                response = await http.get(base.copy_with(path="/health"), timeout=timeout)
        except httpx.PoolTimeout:
            return None
        except httpx.HTTPError:
            return False
        return response.is_success

    async def _open(
        self, path: str, payload: dict[str, Any], headers: Mapping[str, str] | None
    ) -> tuple[int, httpx.Response]:
        """Send to replicas until one answers below 500; return it with its request counted.

        The caller must `release` the index and close the response.
        """
        http = self._client()
        tried: list[int] = []
        server_errors = 0
        for _ in range(min(1 + self.config.retries, len(self._pool))):
            index = self._pool.acquire(exclude=tried)
            tried.append(index)
            request = http.build_request(
                "POST",
                _join(self._base_urls[index], path),
                json=payload,
                headers=_forwarded_headers(headers),
            )
            try:
                response = await http.send(request, stream=True)
            except BaseException as exc:
                self._pool.release(index)
                if isinstance(exc, _REPLICA_FAILURES):
                    self._pool.mark_down(index, type(exc).__name__)
                    continue
                if isinstance(exc, httpx.HTTPError):
                    raise self._send_error(exc) from None
                raise
            if response.status_code >= 500:
                self._pool.release(index)
                self._pool.mark_down(index, f"HTTP {response.status_code}")
                await response.aclose()
                server_errors += 1
                continue
            self._pool.mark_up(index)
            if not response.is_success:
                await self._raise_for_status(index, response)
            return index, response
        raise self._exhausted(len(tried), server_errors)

    async def _raise_for_status(self, index: int, response: httpx.Response) -> None:
        try:
            content = await response.aread()
        except httpx.TimeoutException:
            raise errors.timeout(self._timeout_message()) from None
        except httpx.HTTPError:
            content = b""
        finally:
            self._pool.release(index)
            await response.aclose()
        if response.status_code < 400:
            raise errors.bad_response(f"upstream answered HTTP {response.status_code}")
        raise errors.error_from_client_error(response.status_code, content)

    def _exhausted(self, attempts: int, server_errors: int) -> UpstreamError:
        total = len(self._pool)
        tried = f"{attempts} of {total} replica(s) tried"
        if server_errors:
            return errors.unavailable(
                502, f"upstream '{self.config.model}' failed with server errors ({tried})"
            )
        return errors.unavailable(503, f"upstream '{self.config.model}' is unreachable ({tried})")

    def _send_error(self, exc: BaseException) -> UpstreamError:
        if isinstance(exc, httpx.PoolTimeout):
            return errors.unavailable(503, "too many concurrent upstream requests")
        if isinstance(exc, httpx.TimeoutException):
            return errors.timeout(self._timeout_message())
        return errors.bad_response(f"upstream request failed ({type(exc).__name__})")

    def _stream_error(self, index: int, exc: Exception) -> UpstreamError:
        if isinstance(exc, SSEParseError):
            return errors.bad_response(str(exc))
        if isinstance(exc, httpx.TimeoutException):
            return errors.timeout(self._timeout_message())
        self._pool.mark_down(index, type(exc).__name__)
        return errors.bad_response("upstream closed the stream before it finished")

    def _timeout_message(self) -> str:
        return f"upstream '{self.config.model}' sent nothing for {self.config.read_timeout_s:g} s"

    def _payload(self, body: dict[str, Any], *, stream: bool) -> dict[str, Any]:
        payload = {**body, "model": self.config.model}
        if stream:
            payload["stream"] = True
        else:
            payload.pop("stream", None)
            payload.pop("stream_options", None)
        return payload

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            raise RuntimeError("UpstreamClient.start() has not been called")
        return self._http


def _join(base: httpx.URL, path: str) -> httpx.URL:
    """`base` with `path` appended to its path; query (e.g. api-version) kept."""
    return base.copy_with(path=base.path.rstrip("/") + "/" + path.lstrip("/"))


def _forwarded_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    """Only X-Request-Id crosses to the upstream; the client's own auth never does."""
    for name, value in (headers or {}).items():
        if name.lower() == "x-request-id":
            return {"X-Request-Id": value}
    return {}


async def _drain(chunks: AsyncIterator[bytes]) -> None:
    """Read to the upstream's EOF after [DONE] so the connection can be reused."""
    with contextlib.suppress(httpx.HTTPError, TimeoutError):
        async with asyncio.timeout(_DRAIN_AFTER_DONE_S):
            async for _ in chunks:
                pass
