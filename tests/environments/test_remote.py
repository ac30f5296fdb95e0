"""The remote sandbox's client against a stand-in SandboxFusion service (a small HTTP server in the
test that speaks ``POST /run_code`` as the service's models define it, and really runs the code in
a subprocess with the request's ``run_timeout``): the request's fields, the answer's mapping (output,
tracebacks, the memory and time limits), retries on the service's and the network's failures (504,
502, ``SandboxError``, a stalled answer, no service), no retry of a bad request, an answer too long,
and several runs at once while one hangs. No test needs a real SandboxFusion (not installable here:
it ships as a container image)."""
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_tepo.environments import SandboxConfig, make_sandbox
from megatron_tepo.environments.remote import RemoteSandbox
from megatron_tepo.net import free_port
from tests.environments.conftest import beside_a_hang

pytestmark = pytest.mark.second_lane  # a few seconds of waits: the first lane has none to spare

# SandboxFusion's RunCodeRequest (sandbox/server/sandbox_api.py): every field it takes
REQUEST_FIELDS = {"compile_timeout", "run_timeout", "memory_limit_MB", "code", "stdin", "language", "files",
                  "fetch_files", "args"}


class StandIn:
    """A stand-in SandboxFusion: answers each ``POST /run_code`` by running the code (``sys.executable``,
    ``run_timeout``), unless ``faults`` (popped one per request) says to answer otherwise:
    an HTTP status, ``"sandbox_error"``, or ``"stall"`` (answer after ``stall_s``)."""

    def __init__(self):
        self.requests, self.paths, self.faults = [], [], []
        self.stall_s = 0.0
        self.lock = threading.Lock()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stand_in.lock:
                    stand_in.requests.append(body)
                    stand_in.paths.append(self.path)
                    fault = stand_in.faults.pop(0) if stand_in.faults else None
                if isinstance(fault, int):
                    self.send_error(fault)
                    return
                if fault == "stall":
                    time.sleep(stand_in.stall_s)
                answer = stand_in.answer(body, fault)
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                pass  # the client hangs up on an answer too long to read: expected

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @staticmethod
    def answer(body, fault):
        if fault == "sandbox_error":
            return {"status": "SandboxError", "message": "executor pod lost", "compile_result": None,
                    "run_result": None, "executor_pod_name": None, "files": {}}
        start = time.monotonic()
        try:
            p = subprocess.run([sys.executable, "-c", body["code"]], input=body["stdin"] or "", capture_output=True,
                               text=True, timeout=body["run_timeout"])
            run = {"status": "Finished", "execution_time": time.monotonic() - start, "return_code": p.returncode,
                   "stdout": p.stdout, "stderr": p.stderr}
        except subprocess.TimeoutExpired as e:
            run = {"status": "TimeLimitExceeded", "execution_time": time.monotonic() - start, "return_code": None,
                   "stdout": (e.stdout or b"").decode(), "stderr": (e.stderr or b"").decode()}
        ok = run["status"] == "Finished" and run["return_code"] == 0
        return {"status": "Success" if ok else "Failed", "message": "", "compile_result": None, "run_result": run,
                "executor_pod_name": "stand-in", "files": {}}

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def service():
    s = StandIn()
    yield s
    s.close()


def remote(url, sleeps=None, **kw):
    cfg = SandboxConfig(**{"kind": "remote", "remote_url": url + "/", "wall_seconds": 30.0,
                           "remote_timeout_margin_s": 30.0, "output_bytes": 64 << 10, "shown_bytes": 1024, **kw})
    sb = RemoteSandbox(cfg.check(), sleep=(sleeps.append if sleeps is not None else time.sleep))
    return sb


def test_the_request_and_the_answer_are_sandboxfusions(service):
    sb = make_sandbox(SandboxConfig(kind="remote", remote_url=service.url, memory_mb=512, wall_seconds=30.0))
    assert isinstance(sb, RemoteSandbox)
    r = sb.run("print(input() * 2)", stdin="ab\n")
    assert (r.stdout, r.stderr, r.exit_code, r.limit, r.error, r.sandbox_failed) == ("abab\n", "", 0, None, None, False)
    assert r.info["executor"] == "stand-in"
    assert service.paths == ["/run_code"]
    req = service.requests[0]
    assert set(req) <= REQUEST_FIELDS
    assert req == {"code": "print(input() * 2)", "language": "python", "stdin": "ab\n", "run_timeout": 30.0,
                   "compile_timeout": 30.0, "memory_limit_MB": 512, "files": {}, "fetch_files": []}


def test_tracebacks_and_the_memory_limit_map_as_locally(service):
    sb = remote(service.url)
    r = sb.run("1 / 0")
    assert r.exit_code == 1 and r.limit is None and r.error == "Error: the code exited with status 1."
    assert r.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
    r = sb.run("raise MemoryError")
    assert (r.limit, r.error) == ("memory", "Error: the code ran out of memory (limit 1024 MB).")
    # TimeLimitExceeded: test_runs_at_once_finish_while_one_hangs


def test_gateway_timeouts_and_a_stall_are_retried(service):
    sleeps = []
    service.faults = [504, 502]
    r = remote(service.url, sleeps).run("print('third time')")
    assert (r.stdout, r.error) == ("third time\n", None)
    assert len(service.requests) == 3 and sleeps == [0.5, 1.0]
    service.faults, service.stall_s, sleeps[:] = ["stall"], 4.0, []  # answers after the client's 2 s time-out
    r = remote(service.url, sleeps, wall_seconds=2.0, remote_timeout_margin_s=0.0).run("print('after a stall')")
    assert (r.stdout, r.error) == ("after a stall\n", None) and sleeps == [0.5]


def test_the_services_own_failure_is_retried_then_said_to_be_the_sandboxs(service):
    sleeps = []
    service.faults = ["sandbox_error"] * 3
    r = remote(service.url, sleeps).run("print(1)")
    assert r.sandbox_failed and r.exit_code is None and r.stdout == ""
    assert r.error == "Error: the sandbox could not run the code (SandboxError: executor pod lost)."
    assert len(service.requests) == 3 and sleeps == [0.5, 1.0]


def test_a_bad_request_is_not_retried(service):
    service.faults = [400]
    r = remote(service.url, []).run("print(1)")
    assert r.sandbox_failed and len(service.requests) == 1
    assert r.error == f"Error: the sandbox could not run the code (HTTP 400 from {service.url}/run_code)."


def test_no_service(tmp_path):
    sleeps = []
    r = remote(f"http://127.0.0.1:{free_port()}", sleeps).run("print(1)")
    assert r.sandbox_failed and len(sleeps) == 2
    assert r.error.startswith("Error: the sandbox could not run the code (URLError: ") and "refused" in r.error


def test_output_past_the_limit(service):
    sb = remote(service.url)
    r = sb.run("print('x' * 100_000)")  # an answer within the read bound, output past output_bytes
    assert (r.limit, r.exit_code) == ("output", None)
    assert r.error == f"Error: the code printed more than {64 << 10} bytes and was stopped."
    assert r.stdout.startswith("x" * 512 + "\n[... at least ") and len(r.stdout) < 1100 and r.stdout_cut > 98_000
    r = sb.run("print('x' * 10_000_000)")  # an answer past the read bound: never read whole
    assert (r.limit, r.stdout, r.stdout_cut) == ("output", "", 0)


def test_runs_at_once_finish_while_one_hangs(service):
    sb = remote(service.url, wall_seconds=3.0)
    results, order = beside_a_hang(sb)
    hang = results[0]
    assert (hang.stdout, hang.limit, hang.exit_code) == ("sleeping\n", "wall", None)
    assert hang.error == "Error: the code ran longer than its time limit (3 s) and was stopped."
    assert [(r.stdout, r.error) for r in results[1:]] == [(f"{i * i}\n", None) for i in range(1, 5)]
    assert order[-1] == 0 and sorted(order[:-1]) == [1, 2, 3, 4]
