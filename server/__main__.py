"""python -m server --config strata-<model>.json: the service, until Ctrl-C."""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from server.config import ConfigError, load_config


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server", description="Strata's OpenAI-compatible service.")
    ap.add_argument("--config", required=True, help="strata-<model>.json (written by python -m setup)")
    ap.add_argument("--preload", action="store_true",
                    help="load the model now even when the config says \"load_at_start\": false")
    a = ap.parse_args(argv)
    # The server's log (stderr): worker failures with the worker's last log lines, which clients never see.
    logging.basicConfig(level=logging.WARNING, format="strata: %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(a.config)
    except ConfigError as e:
        print(f"strata: {e}", file=sys.stderr)
        return 2
    from server.app import build
    try:
        httpd = build(cfg)
    except OSError as e:
        print(f"strata: cannot listen on {cfg.host}:{cfg.port}: {e.strerror}; pick another port in the config",
              file=sys.stderr)
        return 2
    except Exception as e:  # the tokenizer could not read the model's vocabulary, for one
        print(f"strata: cannot start: {e}", file=sys.stderr)
        return 2
    host, port = httpd.server_address[:2]
    print(f"strata: serving {cfg.model_name} at http://{host}:{port}/ (chat in the browser, OpenAI API under /v1); "
          f"worker log: {cfg.log}", file=sys.stderr, flush=True)
    if a.preload and not cfg.load_at_start:
        httpd.service.preload()
    if cfg.load_at_start or a.preload:
        print("strata: loading the model (GET /health answers 503 \"loading\" until it is ready)", file=sys.stderr,
              flush=True)
    else:
        print("strata: the model loads at the first request (\"load_at_start\": false)", file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=httpd.shutdown, daemon=True).start())
    try:
        httpd.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        httpd.service.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
