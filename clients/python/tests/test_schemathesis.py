"""schemathesis against openapi.yaml and a live groved (over TCP with the API key): no 5xx, every response
conforms to the spec (status, content type, headers, body schema), schema-invalid input is rejected."""

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest import REPO, Daemon

SPEC = REPO / "groved" / "openapi.yaml"
# Operations left out: importing a node path would let fuzzed paths (e.g. "/") copy the host into the store;
# deleting images would remove the base image under the other tests; the two SSE streams never end; schemathesis
# cannot generate application/x-tar bodies (tar upload is covered by groved/tests/api.rs).
EXCLUDED = ["importImage", "importImageTar", "deleteImage", "events", "execStream", "uploadTar"]
# A build's body is a tar stream schemathesis cannot generate ("no supported serializers for
# application/x-tar"): covered by groved/tests/build.rs with real Dockerfile contexts instead.
EXCLUDED += ["buildImage"]
# SWE-ReX's protocol answers a raised exception with 511 by design (its client re-raises it): covered by
# tests/test_swerex.py through SWE-ReX's own client instead.
EXCLUDED += ["swerexCreateSession", "swerexRunInSession", "swerexCloseSession", "swerexExecute", "swerexReadFile",
             "swerexWriteFile", "swerexUpload", "swerexClose"]
CHECKS = ["not_a_server_error", "status_code_conformance", "content_type_conformance", "response_headers_conformance",
          "response_schema_conformance", "negative_data_rejection"]


def test_schemathesis_finds_no_5xx_and_no_schema_violations():
    st = Path(sys.executable).parent / "schemathesis"
    if not st.exists():
        pytest.fail(f"schemathesis is not installed in {sys.prefix}: pip install schemathesis (scripts/setup should)")
    d = Daemon("fuzz", capacity_sandboxes=6, tcp=True)
    try:
        d.import_base_image()
        args = [str(st), "run", str(SPEC), "--url", f"http://{d.tcp}", "-H", f"Authorization: Bearer {d.api_key}",
                "--checks", ",".join(CHECKS), "--max-examples", "12", "--request-timeout", "60", "--seed", "1",
                "--phases", "examples,coverage,fuzzing,stateful", "--no-color", "--max-time", "60"]
        for op in EXCLUDED:
            args += ["--exclude-operation-id", op]
        r = subprocess.run(args, capture_output=True, text=True, timeout=400, cwd=d.dir)  # its example db goes there
        out = r.stdout[-12000:] + r.stderr[-3000:]
        assert r.returncode == 0, out
        with d.http() as c:
            ids = [s["id"] for s in c.get("/v1/sandboxes", params={"limit": 1000}).json()["items"]]
            if ids:
                c.post("/v1/sandboxes/delete", json={"ids": ids})
            for s in c.get("/v1/snapshots").json().get("items", []):
                c.delete(f"/v1/snapshots/{s['id']}")
    finally:
        d.stop()
