"""The RFC's stage logs (可观测性): one structured line per stage of a request (render ok or
fallback with its cause, the generate leg and its instance, derender failure, retry, relay,
cancellation), each carrying the gateway's request id (the `x-request-id` clients get).

`logging.format: json` makes every log line of the processor one JSON object; the stage
fields are top-level keys there, `key=value` pairs in text.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

STAGE_LOGGER = logging.getLogger("tito.stage")
_RECORD_FIELDS = frozenset(vars(logging.makeLogRecord({})))


def stage(name: str, request_id: str, level: int = logging.INFO, **fields: Any) -> None:
    if STAGE_LOGGER.isEnabledFor(level):
        text = " ".join(f"{key}={value}" for key, value in fields.items())
        extra = {"stage": name, "request_id": request_id, "fields": fields}
        # The record is made here, not by `Logger.log`: that looks up the caller's file and
        # line by walking the stack, which no format of ours prints, and a request's stage
        # line is logged deep in its task's stack (a third of the cost of making the reply
        # that carries it, in a py-spy profile of one-token requests).
        args = (name, request_id, text)
        record = STAGE_LOGGER.makeRecord(STAGE_LOGGER.name, level, "", 0, "%s request=%s %s", args, None, extra=extra)
        STAGE_LOGGER.handle(record)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        stage_name = getattr(record, "stage", None)
        if stage_name is not None:
            line |= {
                "stage": stage_name,
                "request_id": getattr(record, "request_id", ""),
                **getattr(record, "fields", {}),
            }
        else:
            line["message"] = record.getMessage()
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        line |= {
            k: v
            for k, v in vars(record).items()
            if k not in _RECORD_FIELDS and k not in ("stage", "request_id", "fields", "message")
        }
        return orjson.dumps(line, default=str).decode()


def configure_logging(level: str, format_: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter() if format_ == "json" else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
