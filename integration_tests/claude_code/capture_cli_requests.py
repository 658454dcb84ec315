"""Capture the real Claude Code CLI's request bodies for the replay fixture (a developer tool, not a test).

Driving a tiny random model into compaction or into spawning a sub-agent is impractical, so the
tree-shape tests replay requests the real CLI sent. This script produces them: it serves the CLI a
*scripted* Anthropic endpoint (a stand-in model that answers by a fixed script; it is only used
here, to make the CLI take those paths) and writes every request the CLI made to a JSON fixture.

    .venv/bin/python integration_tests/claude_code/capture_cli_requests.py [--out FILE]

Scenarios: ``subagent`` (the main agent calls the Agent tool, the sub-agent answers, the main agent
finishes) and ``compact`` (a Bash call, then usage near the context window makes the CLI compact
its history before the next call, then it finishes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from aiohttp import web

from gyre_core.proxy.anthropic_api import encode_sse, message_events, response_message
from gyre_core.proxy.types import ChatResponse, ToolCall, Usage

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from claude_cli import CLAUDE_CODE_VERSION, claude_env, ensure_cli  # noqa: E402

Policy = Callable[[dict[str, Any], dict[str, str], int], ChatResponse]
SECRET = {"x-api-key", "authorization"}


def _last_user_text(body: dict[str, Any]) -> str:
    for msg in reversed(body["messages"]):
        if msg["role"] == "user":
            c = msg["content"]
            return c if isinstance(c, str) else " ".join(b.get("text", "") for b in c if isinstance(b, dict))
    return ""


def _has_tool_result(body: dict[str, Any]) -> bool:
    last = body["messages"][-1]
    return isinstance(last["content"], list) and any(b.get("type") == "tool_result" for b in last["content"])


def _answer(i: int, text: str = "", calls: tuple[ToolCall, ...] = (), prompt_tokens: int = 900) -> ChatResponse:
    return ChatResponse(
        call_id=f"stub{i}", model="tiny", content=text, reasoning=None, tool_calls=calls,
        finish_reason="tool_calls" if calls else "stop", usage=Usage(prompt_tokens, 12),
    )


def subagent_policy(body: dict[str, Any], headers: dict[str, str], i: int) -> ChatResponse:
    if "x-claude-code-agent-id" in headers:
        return _answer(i, "Done: the sub-agent said hello.")
    if _has_tool_result(body):
        return _answer(i, "Finished.")
    args = {"description": "Say hello", "prompt": "Say hello and stop.", "subagent_type": "general-purpose",
            "run_in_background": False}
    return _answer(i, "", (ToolCall("toolu_stub_agent", "Agent", json.dumps(args)),))


def compact_policy(body: dict[str, Any], headers: dict[str, str], i: int) -> ChatResponse:
    last = _last_user_text(body)
    if "<summary>" in last:
        return _answer(i, "<summary>The user asked to write hello to out.txt; it was done with Bash.</summary>")
    if _has_tool_result(body):
        # Report a context near the window: the CLI compacts before the next turn.
        return _answer(i, "Finished.", prompt_tokens=190_000)
    if "out.txt" in last and "print" not in last.lower():
        args = {"command": "echo hello > out.txt", "description": "Write hello to out.txt"}
        return _answer(i, "", (ToolCall("toolu_stub_bash", "Bash", json.dumps(args)),))
    return _answer(i, "It says hello.")


_FLAGS = ["--dangerously-skip-permissions", "--output-format", "json", "--system-prompt", "You are a coding agent."]
POLICIES: dict[str, tuple[Policy, list[list[str]]]] = {
    "subagent": (subagent_policy, [["-p", "Ask a sub-agent to say hello.", "--tools", "Bash,Agent"]]),
    "compact": (compact_policy, [["-p", "Write hello to out.txt.", "--tools", "Bash"],
                                 ["--continue", "-p", "/compact", "--tools", "Bash"],
                                 ["--continue", "-p", "Now print out.txt.", "--tools", "Bash"]]),
}


async def _serve(policy: Policy, log: list[dict[str, Any]], port: int) -> web.AppRunner:
    async def handle(req: web.Request) -> web.StreamResponse:
        raw = await req.read()
        body = json.loads(raw) if raw else None
        headers = {k.lower(): v for k, v in req.headers.items() if k.lower() not in SECRET}
        entry: dict[str, Any] = {"method": req.method, "path": req.path_qs, "headers": headers, "body": body}
        log.append(entry)
        if req.path != "/v1/messages":
            return web.Response(text="ok")
        resp = policy(body, headers, len(log))
        entry["stub_answer"] = response_message(resp, body["model"])
        if not body.get("stream"):
            return web.json_response(entry["stub_answer"])
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(req)
        for ev, data in message_events(resp, body["model"]):
            await out.write(encode_sse(ev, data))
        await out.write_eof()
        return out

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def capture(name: str) -> list[dict[str, Any]]:
    policy, runs = POLICIES[name]
    log: list[dict[str, Any]] = []
    port = _free_port()
    runner = await _serve(policy, log, port)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            env = claude_env(Path(scratch), f"http://127.0.0.1:{port}", "capture-key", "tiny")
            for run in runs:
                log.append({"path": "/v1/messages#new-cli-run", "argv": run})
                proc = await asyncio.create_subprocess_exec(str(ensure_cli()), *run, *_FLAGS, cwd=scratch, env=env,
                                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                out, err = await asyncio.wait_for(proc.communicate(), 180)
                print(name, "exit", proc.returncode, out.decode()[-300:], err.decode()[-300:], file=sys.stderr)
    finally:
        await runner.cleanup()
    return [e for e in log if e["path"].startswith("/v1/messages")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=HERE / "fixtures" / f"claude_code_{CLAUDE_CODE_VERSION}_requests.json")
    ap.add_argument("--scenario", action="append", choices=sorted(POLICIES))
    args = ap.parse_args()
    result = {"claude_code_version": CLAUDE_CODE_VERSION}
    for name in args.scenario or sorted(POLICIES):
        result[name] = asyncio.run(capture(name))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print("wrote", args.out, file=sys.stderr)


if __name__ == "__main__":
    main()
