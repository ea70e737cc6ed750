"""SIGTERM: groved stops taking work, lets in-flight requests finish, destroys its sandboxes, exits 0, no residue."""

import signal
import threading
import time

import grove
from conftest import Daemon


def test_sigterm_drains_in_flight_requests():
    d = Daemon("drain")
    try:
        d.import_base_image()
        c = grove.Client(socket=d.socket, retry=grove.RetryPolicy(attempts=1))
        sbx = grove.Sandbox.create(client=c)
        result = {}

        def long_exec():
            result["r"] = sbx.exec("sleep 2; echo finished")

        t = threading.Thread(target=long_exec)
        t.start()
        time.sleep(0.7)
        d.proc.send_signal(signal.SIGTERM)
        t.join(timeout=30)
        assert result["r"].exit_code == 0 and result["r"].stdout == "finished\n"
        # No new work once draining (refused connection, or 503 on a still-open one).
        try:
            grove.Sandbox.create(client=c)
            raise AssertionError("a create was accepted after SIGTERM")
        except (grove.ConnectionFailed, grove.Unavailable):
            pass
        assert d.proc.wait(timeout=60) == 0
        c.close()
    finally:
        d.stop()  # asserts exit 0 and no leftovers (sandbox destroyed, mounts and cgroups gone)
