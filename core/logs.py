"""Structured logging: ``log.info("msg", extra={"kv": {...}})`` prints ``msg key=value ...``."""

from __future__ import annotations

import json
import logging
import sys
import time


class _KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        kv = getattr(record, "kv", None) or {}
        ts = time.strftime("%H:%M:%S", time.localtime(record.created))
        extra = " ".join(f"{k}={v}" for k, v in kv.items())
        line = f"{ts}.{int(record.msecs):03d} {record.levelname:<7} {record.name}: "
        line += record.getMessage() + (f" {extra}" if extra else "")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **(getattr(record, "kv", None) or {}),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str = "info", as_json: bool = False) -> None:
    """Configure the root logger once per process (services call this from main)."""
    lvl = logging.getLevelName(level.upper())
    if not isinstance(lvl, int):
        raise SystemExit(f"unknown log level {level!r}; use debug, info, warning or error")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if as_json else _KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(lvl)
