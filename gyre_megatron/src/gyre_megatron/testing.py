"""Test and benchmark helpers: synthetic micro-steps (``{tokens, labels, loss_mask, index}`` rows),
and torchrun "nodes" on one machine (how a cluster starts Gyre's ranks, on loopback).

The streaming schedule is generic over what a micro-step holds; these plain next-token rows with
a random loss mask exercise it with megatron-core's own per-token cross-entropy.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

__all__ = ["build_checkpoint", "gpu_report", "read_weights", "feed_in_bursts", "free_port", "make_items", "make_microsteps", "rank_store", "kill_once_joined", "start_torchrun_nodes",
           "stop_nodes", "strike_once_joined", "wait_claimed"]


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
"""Llama 3.1's RoPE scaling, for :func:`build_checkpoint`'s ``rope_scaling``."""

YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
"""Qwen3's YaRN setting (a factor of 4) over a short original window, so that it changes every
position of a test row."""


def build_checkpoint(path: Path, tied: bool = False, seed: int = 11, family: str = "qwen2",
                     rope_scaling: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """A small HF checkpoint of ``family`` written to ``path`` (GQA: 6 heads over 2 KV groups,
    hidden 48, FFN 80, 4 layers, vocabulary 160; Qwen3 with a head size of 16, not 48 / 6, and
    Llama with 12; Qwen3-MoE with Qwen3's attention and 6 experts, 2 per token), so the settings
    a family adds are exercised), with random biases and
    norm scales so their layouts are exercised; returns the tensors of its weight file. Built locally: nothing is
    downloaded. ``rope_scaling`` (e.g. :data:`LLAMA3_ROPE`) scales RoPE as Llama 3.x does, with
    Llama 3.1's 131,072 positions."""
    import transformers

    from gyre_megatron.families import family_named

    fam = family_named(family)
    assert fam is not None, family
    own = {"qwen3": {"head_dim": 16}, "llama": {"head_dim": 12},
           # 6 experts of width 24, 2 per token, renormalised: routing is exercised, and the
           # experts split evenly over 2 expert-parallel (or tensor-parallel) ranks
           "qwen3_moe": {"head_dim": 16, "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                         "norm_topk_prob": True}}.get(family, {})
    torch.manual_seed(seed)
    cfg = getattr(transformers, fam.config_class)(
        vocab_size=160, hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=(131072 if rope_scaling.get("rope_type") == "llama3" else 128)
        if rope_scaling else 128, rope_theta=50000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=tied, torch_dtype="float32",
        **({"rope_scaling": dict(rope_scaling)} if rope_scaling else {}), **own)
    model = getattr(transformers, fam.architecture)(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:  # non-trivial biases and norm scales
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(str(path), safe_serialization=True)
    # the checkpoint's own tensors (transformers 5 fuses experts in memory, not in the file)
    state = read_weights(path)
    if tied:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    return state


def read_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint folder: one ``model.safetensors`` or one file per stage."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        part = load_file(str(f))
        assert not set(part) & set(out), f"{f}: tensors also in another file"
        out.update(part)
    return out


def make_items(n: int, seq_len: int = 16, vocab: int = 128, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = torch.randint(0, vocab, (1, seq_len + 1), generator=g)
        mask = (torch.rand(1, seq_len, generator=g) > 0.2).float()
        out.append({"tokens": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous(), "loss_mask": mask,
                    "index": torch.tensor(i)})
    return out


def make_microsteps(n: int, rows: int = 2, seq_len: int = 16, vocab: int = 128, seed: int = 0) -> list[Any]:
    """Real data-plane :class:`MicroStep` values (one pack of ``rows`` rows, the longest exactly
    ``seq_len`` tokens): a context prefix, then a sampled response whose tokens carry ``W_t``."""
    from gyre_core.dataplane.materialise import TrainingRow
    from gyre_core.dataplane.packing import MicroStep, Pack
    from gyre_core.interfaces import RoleClass
    from gyre_core.trajectory import NO_RESPONSE, TrajectoryRow

    g = torch.Generator().manual_seed(seed)
    n_exec = n * rows
    out = []
    for i in range(n):
        packed = []
        for j in range(rows):
            length = seq_len if j == 0 else int(torch.randint(seq_len // 2, seq_len + 1, (1,), generator=g))
            ctx = length // 2
            mask = torch.zeros(length, dtype=torch.bool)
            mask[ctx:] = True
            rid = torch.full((length,), NO_RESPONSE, dtype=torch.int64)
            rid[ctx:] = 1000 * i + j
            lp = torch.where(mask, -torch.rand(length, generator=g), torch.zeros(length))
            row = TrajectoryRow(i * rows + j, i, RoleClass.MAIN_AGENT_TASK,
                                torch.randint(0, vocab, (length,), generator=g), mask, lp, rid)
            weights = torch.where(mask, torch.full((length,), 1.0 / (n_exec * (length - ctx))), torch.zeros(length))
            packed.append(TrainingRow(row, i * rows + j, 1.0, weights))
        out.append(MicroStep(0, i, (Pack(tuple(packed), n_exec),)))
    return out


def wait_claimed(q: Any, timeout: float = 30.0) -> None:
    """Wait (bounded) until every item put into ``q`` has been claimed by some cell."""
    deadline = time.monotonic() + timeout
    while q.unclaimed() > 0 and time.monotonic() < deadline:
        time.sleep(0.05)


def feed_in_bursts(q: Any, items: Sequence[Any], burst: int, gap_s: float, close: bool = True) -> threading.Thread:
    """Put ``items`` into ``q`` ``burst`` at a time, ``gap_s`` apart, in a thread; then close."""

    def run() -> None:
        for i, it in enumerate(items):
            q.put(it)
            if (i + 1) % burst == 0 and i + 1 < len(items):
                time.sleep(gap_s)
        if close:
            q.close()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def rank_store(port: int, timeout_s: float = 10.0) -> Any:
    """A client of the c10d store that the ranks of a local world (:attr:`World.port
    <gyre_megatron.launch.World.port>`) keep their step keys in (``gyre/step{S}/join{C}``,
    ``.../claimed{C}``): what a fault test watches to strike at a known point of a step. The two
    prefixes are the ones ``init_process_group`` puts before its default group's keys."""
    from datetime import timedelta

    import torch.distributed as dist

    tcp = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore("0/", dist.PrefixStore("default_pg", tcp))


async def strike_once_joined(store: Any, step: int, cell: int, strike: Any, timeout_s: float = 600.0,
                             claim_wait_s: float = 1.0) -> str:
    """Wait until cell ``cell`` has joined step ``step`` (its key in the ranks' store), give it
    ``claim_wait_s`` to claim micro-steps, then call ``strike()`` (kill it). Returns what the cell
    had claimed (``"1,4,"``: the micro-step indices a finished step must stream again).

    A claim puts the strike inside the step; without one, a wait lets a short step end first and
    the strike land between steps. ``claim_wait_s = 0`` strikes as the cell registers: the step
    cannot end before its gradient reduction, which waits for the joined cell."""
    import asyncio

    joined, claimed = f"gyre/step{step}/join{cell}", f"gyre/step{step}/claimed{cell}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await asyncio.sleep(0.01)
        if store.check([joined]) and store.get(joined) == b"joined":
            t = time.monotonic()  # a moment to claim, if the core leaves it any
            while time.monotonic() - t < claim_wait_s and not (store.check([claimed]) and store.get(claimed)):
                await asyncio.sleep(0.01)
            strike()
            return store.get(claimed).decode() if store.check([claimed]) else ""
    raise TimeoutError(f"cell {cell} did not join step {step} within {timeout_s:.0f} s")


def kill_once_joined(step: int, cell: int, kill: Callable[[Any], dict[str, Any]], claim_wait_s: float = 1.0
                     ) -> tuple[Callable[[dict[str, Any]], None], dict[str, Any], dict[str, Any]]:
    """A live run's ``on_started`` (:func:`gyre_core.orchestrator.embedded.run_live`) that calls
    ``kill(world)`` once cell ``cell`` has joined step ``step`` (:func:`strike_once_joined`).

    Returns ``(on_started, parts, killed)``: ``parts`` is what the run handed ``on_started``;
    ``killed`` holds what ``kill`` returned, ``at`` (the orchestrator's clock) and ``claimed``, or
    ``error`` when the strike never came (kept for the test's assertion, not lost in a task)."""
    parts: dict[str, Any] = {}
    killed: dict[str, Any] = {}

    async def strike() -> None:
        try:
            orch = parts["orchestrator"]
            world = orch.cells[cell].training.world
            claimed = await strike_once_joined(rank_store(world.port), step, cell,
                                               lambda: killed.update(kill(world)), claim_wait_s=claim_wait_s)
            killed.update(at=orch.now(), claimed=claimed)
        except Exception as e:
            killed["error"] = f"{type(e).__name__}: {e}"

    def on_started(p: dict[str, Any]) -> None:
        parts.update(p)
        parts["killer"] = p["loop"].create_task(strike())

    return on_started, parts, killed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_torchrun_nodes(nodes: int, per_node: int, control: str, key_file: Path, log_dir: Path,
                         extra_env: dict[str, str] | None = None,
                         node_env: Sequence[dict[str, str]] = ()) -> list[subprocess.Popen[bytes]]:
    """``nodes`` torchrun agents on this machine, as a multi-node job would run them
    (``node_env[i]``: what only node ``i`` sets, e.g. the address it advertises)."""
    master = free_port()
    procs = []
    for node in range(nodes):
        env = {**os.environ, "GYRE_CONTROL": control, "GYRE_CONTROL_KEY_FILE": str(key_file),
               "OMP_NUM_THREADS": "1", **(extra_env or {}), **(node_env[node] if node < len(node_env) else {})}
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node-rank={node}",
               f"--nproc-per-node={per_node}", "--master-addr=127.0.0.1", f"--master-port={master}",
               "-m", "gyre_megatron.worker"]
        log = open(log_dir / f"node{node}.log", "wb")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        log.close()
    return procs


def stop_nodes(procs: list[subprocess.Popen[bytes]], grace: float = 20.0) -> list[int | None]:
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    codes = [p.poll() for p in procs]
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
    return codes


def make_gspo_microsteps(hf: Any, offsets: Sequence[float | Sequence[float]], advantages: Sequence[float],
                         execs_per_step: int = 2, rows_per_exec: int = 2, seq_len: int = 16, vocab: int = 128,
                         seed: int = 0, spike: dict[int, float] | None = None,
                         split: Sequence[int] = (), temperature: float = 1.0) -> list[Any]:
    """Data-plane micro-steps for GSPO checks, one pack each. Execution ``e`` has ``rows_per_exec``
    rows of a context prefix then sampled tokens; its behaviour log-probs are ``hf``'s own
    (float64) minus ``offsets[e]`` (one number, or one per row), so its token ratios are known
    exactly under those weights; ``spike[e]`` adds that much more to the first sampled token's
    ``δ`` (to reach the cap). Executions are whole in their pack (as the stream packer keeps them)
    except those in ``split``: their row ``j`` goes to the micro-step ``j`` after their own, and
    each part's pack carries the other rows (``Pack.outside``) as the packer does. With
    ``temperature``, the behaviour log-probs are those of ``softmax(logits / temperature)`` and the
    rows say so, as the proxy records a call sampled at that temperature."""
    from gyre_core.dataplane.materialise import TrainingRow
    from gyre_core.dataplane.packing import MicroStep, _pack
    from gyre_core.interfaces import RoleClass
    from gyre_core.trajectory import NO_RESPONSE, TrajectoryRow

    n_exec = len(offsets)
    assert len(advantages) == n_exec and n_exec % execs_per_step == 0
    n_micro = n_exec // execs_per_step
    g = torch.Generator().manual_seed(seed)
    spike = dict(spike or {})
    rows_of: list[list[Any]] = []
    for e in range(n_exec):
        rows = []
        sampled = 0
        specs = []
        per_row = offsets[e] if isinstance(offsets[e], (list, tuple)) else [offsets[e]] * rows_per_exec
        assert len(per_row) == rows_per_exec
        for j in range(rows_per_exec):
            length = seq_len if j == 0 else int(torch.randint(seq_len // 2, seq_len + 1, (1,), generator=g))
            specs.append((length, length // 2))
            sampled += length - length // 2
        for j, (length, ctx) in enumerate(specs):
            tokens = torch.randint(0, vocab, (length,), generator=g)
            with torch.no_grad():
                logits = hf(tokens[None]).logits[0].double() / temperature
                lp = torch.log_softmax(logits, -1)[:-1].gather(-1, tokens[1:, None])[:, 0]
            lp = torch.cat([torch.zeros(1, dtype=torch.float64), lp])
            mask = torch.zeros(length, dtype=torch.bool)
            mask[ctx:] = True
            delta = torch.full((length,), float(per_row[j]), dtype=torch.float64)
            if j == 0 and e in spike:
                delta[ctx] += spike[e]
            behaviour = torch.where(mask, lp - delta, torch.zeros(length, dtype=torch.float64)).float()
            rid = torch.full((length,), NO_RESPONSE, dtype=torch.int64)
            rid[ctx:] = 1000 * e + j
            row = TrajectoryRow(e, e // execs_per_step, RoleClass.MAIN_AGENT_TASK, tokens, mask, behaviour, rid,
                                temperatures=torch.full((length,), float(temperature)))
            weights = torch.where(mask, torch.full((length,), 1.0 / (n_exec * sampled)), torch.zeros(length))
            rows.append(TrainingRow(row, e, float(advantages[e]), weights))
        rows_of.append(rows)
    placed: list[list[Any]] = [[] for _ in range(n_micro)]
    for e, rows in enumerate(rows_of):
        home = e // execs_per_step
        for j, r in enumerate(rows):
            placed[(home + j) % n_micro if e in split else home].append(r)
    parts = {e: tuple(rows_of[e]) for e in split}
    return [MicroStep(0, i, (_pack(tuple(rows), n_exec, parts),)) for i, rows in enumerate(placed)]


def gpu_report(check: str, **figures: Any) -> None:
    """One JSON line for ``scripts/gpu-check.sh``: the check's name and the figures it measured,
    printed and appended to ``$GYRE_GPU_REPORT`` when set."""
    import json

    line = json.dumps({"check": check, **figures})
    print("\n" + line)
    if os.environ.get("GYRE_GPU_REPORT"):
        with open(os.environ["GYRE_GPU_REPORT"], "a") as f:
            f.write(line + "\n")
