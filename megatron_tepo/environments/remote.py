"""Tool code on a remote SandboxFusion service, for clusters that forbid user namespaces:
:class:`RemoteSandbox`, the same :class:`~.sandbox.Sandbox` interface over HTTP.

SandboxFusion (ByteDance, Apache-2.0; the service verl's sandbox reward and tool use call) runs code
in its own isolated executors. One run is ``POST {remote_url}/run_code`` with a JSON body

    {"code": ..., "language": "python", "stdin": ..., "run_timeout": wall_seconds,
     "compile_timeout": wall_seconds, "memory_limit_MB": memory_mb, "files": {}, "fetch_files": []}

and the answer ``{"status": "Success" | "Failed" | "SandboxError", "message": ..., "compile_result":
null, "run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error", "execution_time": s,
"return_code": n, "stdout": ..., "stderr": ...}, "executor_pod_name": ..., "files": {}}``.
Checked against: the service's own request and response models (``sandbox/server/sandbox_api.py``:
``RunCodeRequest``, ``RunCodeResponse``, ``RunStatus``; ``sandbox/runners/types.py``:
``CommandRunResult``, ``CommandRunStatus``, in github.com/bytedance/SandboxFusion), its client
package on PyPI (``sandbox-fusion`` 0.3.7: the ``/run_code`` path under a base URL, default port
8080, a retry on any non-200 answer and on ``SandboxError``), and verl's client
(``verl/utils/reward_score/sandbox_fusion/utils.py``: the same fields, a retry on HTTP 504).
``memory_limit_MB`` is in the service's current model and absent from client 0.3.7's; a service that
predates it ignores it (pydantic drops unknown fields).

What maps to what: ``TimeLimitExceeded`` is the ``wall`` limit; ``Finished`` with a non-zero
``return_code`` the exit status (with the limit read from stderr as locally: ``MemoryError`` is
``memory``...); ``SandboxError`` (or a run status ``Error``), a connection error, a time-out, HTTP
429 or 5xx are retried ``remote_retries`` times with a growing pause (0.5 s, 1 s, 2 s...) and then
reported as ``sandbox_failed`` (never the model's doing); another HTTP status (a 4xx: a malformed
request) fails at once. Output: the answer is read up to a bound (8 x ``output_bytes`` plus 64 KiB of
JSON); a longer one is the ``output`` limit. Each stream is then cut to ``shown_bytes`` as locally.
The service limits wall time and memory; CPU time, process count and output size are its own
business (its executors' settings). The request's time-out is ``wall_seconds +
remote_timeout_margin_s``.

Standard library only (``urllib``); one HTTP connection per run, so runs from many threads at once
share nothing but the slots (``max_concurrent``).
"""
from __future__ import annotations

import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Optional, Tuple

from megatron_tepo.environments.sandbox import OutputCap, ToolResult, classify_exit, limit_message
from megatron_tepo.environments.settings import SandboxConfig

__all__ = ["RemoteSandbox"]

log = logging.getLogger(__name__)

_RETRY_HTTP = {429, 500, 502, 503, 504}


class _Retry(Exception):
    """A failure worth another try (the service's, or the network's)."""


class _Fatal(Exception):
    """A failure another try would repeat (a 4xx: the request itself is wrong)."""


class RemoteSandbox:
    """A SandboxFusion service behind :class:`~.sandbox.Sandbox` (the module docstring has the API).
    ``sleep`` is the pause between tries (tests pass a recorder)."""

    def __init__(self, cfg: SandboxConfig, sleep=time.sleep):
        self.cfg = cfg
        self.url = cfg.remote_url.rstrip("/") + "/run_code"
        self._slots = threading.BoundedSemaphore(cfg.max_concurrent)
        self._sleep = sleep
        self._limits = {k: getattr(cfg, k) for k in ("wall_seconds", "cpu_seconds", "memory_mb", "processes",
                                                   "output_bytes", "tmp_mb")}
        self._max_body = 8 * cfg.output_bytes + (64 << 10)

    def close(self) -> None:
        pass

    def request_body(self, code: str, stdin: str) -> dict:
        """The ``/run_code`` request for one run."""
        return {"code": code, "language": "python", "stdin": stdin, "run_timeout": self.cfg.wall_seconds,
                "compile_timeout": self.cfg.wall_seconds, "memory_limit_MB": self.cfg.memory_mb,
                "files": {}, "fetch_files": []}

    def run(self, code: str, *, stdin: str = "") -> ToolResult:
        with self._slots:
            start = time.monotonic()
            body = json.dumps(self.request_body(code, stdin)).encode("utf-8")
            why = "no try made"
            for attempt in range(self.cfg.remote_retries):
                if attempt:
                    self._sleep(0.5 * 2 ** (attempt - 1))
                try:
                    answer, too_long = self._post(body)
                    if too_long:
                        return self._output_limit(time.monotonic() - start)
                    return self._result(answer, time.monotonic() - start)
                except _Retry as e:
                    why = str(e)
                    log.warning("remote sandbox %s: try %d of %d failed: %s", self.url, attempt + 1,
                                self.cfg.remote_retries, why)
                except _Fatal as e:
                    why = str(e)
                    break
            return self._failed(why, time.monotonic() - start)

    def _post(self, body: bytes) -> Tuple[Optional[dict], bool]:
        req = urllib.request.Request(self.url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", "Accept": "application/json"})
        timeout = self.cfg.wall_seconds + self.cfg.remote_timeout_margin_s
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read(self._max_body + 1)
        except urllib.error.HTTPError as e:
            if e.code in _RETRY_HTTP:
                raise _Retry(f"HTTP {e.code}") from None
            raise _Fatal(f"HTTP {e.code} from {self.url}") from None
        except (urllib.error.URLError, socket.timeout, TimeoutError, ConnectionError, OSError) as e:
            raise _Retry(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from None
        if len(raw) > self._max_body:
            return None, True
        try:
            answer = json.loads(raw.decode("utf-8"))
        except ValueError as e:
            raise _Retry(f"the answer is not JSON ({e})") from None
        if not isinstance(answer, dict) or "status" not in answer:
            raise _Retry("the answer has no 'status'")
        run = answer.get("run_result") or {}
        if answer["status"] == "SandboxError" or run.get("status") == "Error":
            raise _Retry(f"SandboxError: {str(answer.get('message') or '')[:200]}")
        return answer, False

    def _result(self, answer: dict, seconds: float) -> ToolResult:
        run = answer.get("run_result") or {}
        caps = []
        for name in ("stdout", "stderr"):
            cap = OutputCap(self.cfg.shown_bytes)
            cap.add((run.get(name) or "").encode("utf-8"))
            caps.append(cap)
        out, err = caps
        if out.total + err.total > self.cfg.output_bytes:
            return self._output_limit(seconds, out, err)
        stderr = err.text()
        if run.get("status") == "TimeLimitExceeded":
            exit_code, limit = None, "wall"
        else:
            exit_code = run.get("return_code")
            if not isinstance(exit_code, int):
                exit_code = 0 if answer["status"] == "Success" else 1
            limit = classify_exit(exit_code, stderr)
        info = {"executor": answer.get("executor_pod_name"), "execution_time": run.get("execution_time")}
        return ToolResult(stdout=out.text(), stderr=stderr, exit_code=exit_code, seconds=seconds, limit=limit,
                          error=limit_message(limit, exit_code, self._limits), stdout_cut=out.cut,
                          stderr_cut=err.cut, info=info)

    def _output_limit(self, seconds: float, out: Optional[OutputCap] = None,
                      err: Optional[OutputCap] = None) -> ToolResult:
        out = out or OutputCap(self.cfg.shown_bytes)
        err = err or OutputCap(self.cfg.shown_bytes)
        return ToolResult(stdout=out.text(stopped=True), stderr=err.text(stopped=True), exit_code=None,
                          seconds=seconds, limit="output", error=limit_message("output", None, self._limits),
                          stdout_cut=out.cut, stderr_cut=err.cut)

    def _failed(self, why: str, seconds: float) -> ToolResult:
        log.error("remote sandbox %s failed: %s", self.url, why)
        return ToolResult(stdout="", stderr="", exit_code=None, seconds=seconds, sandbox_failed=True,
                          error=f"Error: the sandbox could not run the code ({why}).")
