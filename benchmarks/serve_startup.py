"""Seconds from launching `specserve serve` to its /health answering 200, with the server's log lines
timestamped from the launch; the server is stopped (SIGTERM) once healthy.

    python benchmarks/serve_startup.py [--port 8123] [-- extra serve flags]
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
import time
import urllib.request


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=8123, help="port for the server (default 8123)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for health (default 900)")
    ap.add_argument("serve_args", nargs="*", help="flags passed to `specserve serve` (after --)")
    args = ap.parse_args()
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "specserve.cli", "serve", "--port", str(args.port), *args.serve_args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def pump() -> None:
        for line in proc.stdout:
            print(f"[{time.monotonic() - t0:7.2f}] {line.rstrip()}", flush=True)

    threading.Thread(target=pump, daemon=True).start()
    healthy = None
    while time.monotonic() - t0 < args.timeout and proc.poll() is None:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=1).status == 200:
                healthy = time.monotonic() - t0
                break
        except OSError:
            pass
        time.sleep(0.05)
    print(f"start to healthy: {healthy:.2f} s" if healthy is not None else "never healthy", flush=True)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    sys.exit(0 if healthy is not None else 1)


if __name__ == "__main__":
    main()
