"""Record a test InvokeAI server's progress events: run with the InvokeAI venv's python (it has socketio).

    python tests/invokeai_events.py URL OUT.jsonl

Connects to the server's socket.io endpoint (websocket transport: InvokeAI's middleware breaks long polling), joins
the default queue's room and appends one JSON line per ``invocation_progress`` event (node type, graph
node id, message, percentage, queue item) to OUT.jsonl until it is terminated. Prints ``subscribed`` once
it listens, so the caller knows no event is missed after that.
"""

from __future__ import annotations

import json
import sys
import time

import socketio


def main(url: str, out_path: str) -> None:
    client = socketio.Client(reconnection=False)
    out = open(out_path, "a", buffering=1)  # noqa: SIM115 - open for the life of the process

    @client.on("invocation_progress")
    def on_progress(data: dict) -> None:
        invocation = data.get("invocation") or {}
        record = {
            "item_id": data.get("item_id"),
            "type": invocation.get("type"),
            "node": data.get("invocation_source_id"),
            "message": data.get("message"),
            "percentage": data.get("percentage"),
        }
        out.write(json.dumps(record) + "\n")

    client.connect(url, socketio_path="/ws/socket.io", transports=["websocket"])
    client.emit("subscribe_queue", {"queue_id": "default"})
    time.sleep(1.0)  # the room join is handled asynchronously
    print("subscribed", flush=True)
    client.wait()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
