"""Checks, benchmarks and test hooks of a cell rank, kept apart from the training path.

Mixed into :class:`gyre_megatron.runtime.CellRank`: everything here is reached only by tests and
``benchmarks/`` (stock-vs-streaming comparison, timing, exposure of arbitrary buffers, state
digests and snapshots, the data-group timeout probe, fault injection).
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from gyre_megatron import compat
from gyre_megatron.figures import objective_figures
from gyre_megatron.model import gpt_forward_step

__all__ = ["RankChecks"]


class RankChecks:
    """Methods that assume the attributes of :class:`~gyre_megatron.runtime.CellRank`."""

    # ------------------------------------------------------------------ §2 checks
    def stock_vs_stream(self, items: list[dict[str, torch.Tensor]], queue_idx: int) -> dict[str, Any]:
        """Cell-local: stock 1F1B over ``items``, then the streaming schedule over the queue."""
        self.zero_grads()
        t0 = time.monotonic()
        rows, seq = items[0]["tokens"].shape
        stock_losses = compat.stock_1f1b(gpt_forward_step, items, self.model, seq, rows)
        t_stock = time.monotonic() - t0
        stock_grads = self.grads_numpy()
        self.zero_grads()
        t0 = time.monotonic()
        res = self._stream(self._control(queue_idx))
        t_stream = time.monotonic() - t0
        out = {"stock_losses": [float(d["loss_sum"]) for d in stock_losses],
               "stream_losses": [float(d["loss_sum"]) for d in res.losses],
               "stock_grads": stock_grads, "stream_grads": self.grads_numpy(),
               "micro_steps": res.micro_steps, "tokens": res.tokens, "pauses": res.pauses,
               "paused_s": res.paused_s, "t_stock": t_stock, "t_stream": t_stream}
        self.zero_grads()
        return out

    def time_schedules(self, items: list[dict[str, torch.Tensor]], repeats: int) -> dict[str, float]:
        """Benchmark: stock vs streaming (items fed from memory, no queue) on the same items."""
        ts, tt = [], []
        for _ in range(repeats):
            self.zero_grads()
            dist.barrier(group=self.side_group)
            t0 = time.perf_counter()
            compat.stock_1f1b(gpt_forward_step, items, self.model, items[0]["tokens"].shape[1],
                              items[0]["tokens"].shape[0])
            dist.barrier(group=self.side_group)
            ts.append(time.perf_counter() - t0)
            self.zero_grads()
            dist.barrier(group=self.side_group)
            t0 = time.perf_counter()
            self._stream(self._control(None, items))
            dist.barrier(group=self.side_group)
            tt.append(time.perf_counter() - t0)
        self.zero_grads()
        return {"stock_s": min(ts), "stream_s": min(tt)}

    # ------------------------------------------------------------------ benchmarks
    def expose_buffer(self, key: str, nbytes: int) -> None:
        """Core: expose ``nbytes`` of data through the same path as the weights (benchmark)."""
        self.satellite_weights.release()  # the previous buffer's registration must go before it is freed
        self._bench_buf = torch.randn(nbytes // 4)
        self.satellite_weights.expose(key, 0, [self._bench_buf])

    def pull_buffer(self, key: str, nbytes: int) -> tuple[int, float]:
        """Satellite: pull what :meth:`expose_buffer` exposed; (bytes, seconds)."""
        buf = torch.empty(nbytes // 4)
        try:
            return self.satellite_weights.pull(key, [buf])
        finally:
            self.satellite_weights.release()

    # ------------------------------------------------------------------ export test
    def grads_hf(self) -> dict[str, Any]:
        """This stage's accumulated gradients under HF names (the export's mapping)."""
        return self._as_hf({n: p.main_grad for n, p in self.ddp.module.named_parameters()})

    def update_grads_hf(self) -> dict[str, Any]:
        """Core, with ``keep_update_grads``: the last update's gradient (HF names), as the optimizer got it."""
        return dict(getattr(self, "update_grads", {}))

    def stream_grads_hf(self, queue_idx: int, objective: Any = None) -> dict[str, Any]:
        """Cell-local: stream the queue through the pipeline, return the gradients (HF names)
        and, on the last stage, the objective's figures; applies no update, leaves no grads.
        ``objective``: an :class:`~gyre_core.interfaces.ObjectiveConfig` in place of the run's."""
        self.zero_grads()
        res = self._stream(self._control(queue_idx, objective=objective))
        self._sum_tensor_partial_grads()  # as a step does before its update
        out: dict[str, Any] = {"grads": self.grads_hf(), "micro_steps": res.micro_steps}
        if self.rank == self.last:
            out["objective"] = objective_figures(res.losses, res)
        self.zero_grads()
        return out

    def logits(self, tokens: torch.Tensor) -> Any:
        """Core, PP = 1 only: the model's logits for ``tokens`` ([1, S]) (export test)."""
        assert self.opts.pp == 1
        with torch.no_grad():
            out = self.ddp.module(tokens, torch.arange(tokens.shape[1]).unsqueeze(0), None)
        return out.detach().clone().cpu().numpy()

    def step_peak_memory(self, queue_idx: int) -> dict[str, float]:
        """Stream the queue (as :meth:`stream_grads_hf`, no update) and report this rank's
        memory: resident before, and the peak during it (Linux: the kernel's high-water mark,
        reset first), in MiB, with the seconds it took (activation-recompute benchmark)."""
        import time

        def rss_mib(field: str) -> float:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith(field + ":"):
                        return int(line.split()[1]) / 1024
            return float("nan")

        with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current RSS
            f.write("5")
        before = rss_mib("VmRSS")
        self.zero_grads()
        t0 = time.monotonic()
        self._stream(self._control(queue_idx))
        seconds = time.monotonic() - t0
        self.zero_grads()
        return {"rss_before_mib": before, "peak_mib": rss_mib("VmHWM"), "seconds": seconds}

    def drop_reference(self) -> None:
        """Let go of the reference policy :meth:`hold_reference` kept (KL tests)."""
        self.reference = None

    def settings_in_effect(self, names: list[str]) -> dict[str, Any]:
        """Each named field as this rank's ``TransformerConfig``, DDP config and (core) optimizer
        config hold it (the first that has it, as a string for enums), and the core's current
        learning rate and weight decay per parameter group (``[training.megatron]`` test)."""
        import enum

        holders = [self.config, self.ddp.ddp_config]
        if self.optimizer is not None:
            holders.append(self.optimizer.config)
        out: dict[str, Any] = {}
        for name in names:
            for h in holders:
                if hasattr(h, name):
                    v = getattr(h, name)
                    out[name] = v.name if isinstance(v, enum.Enum) else v
                    break
        if self.optimizer is not None:
            out["param_groups"] = [{"lr": g["lr"], "weight_decay": g["weight_decay"]}
                                   for g in self.optimizer.param_groups]
        out["transformer_impl"] = self.transformer_impl
        out["parameter_names"] = [n for n, _ in self.ddp.module.named_parameters()]
        return out

    def state_digest(self) -> str:
        h = hashlib.sha256()
        for t in self._state_tensors():
            # clone first: .numpy() on the live tensor would pin its storage (no longer resizable)
            h.update(t.detach().clone().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
        return h.hexdigest()

    # ------------------------------------------------------------------ test support
    def save_state(self) -> None:
        import copy

        self._saved = ([p.clone() for p in self.params],
                       copy.deepcopy(self.optimizer.state_dict()) if self.optimizer is not None else None,
                       self.version)

    def restore_state(self) -> None:
        params, opt, version = self._saved
        for p, s in zip(self.params, params):
            p.copy_(s)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(opt)
        self.version = version
        self.zero_grads()

    def probe_data_timeout(self, wait_s: float) -> str:
        """Negative control for the pause test: a plain recv on the pipeline (data) group while
        the sender sleeps ``wait_s`` -- what a pause would do without the side group."""
        import torch.distributed as d

        t = torch.zeros(4)
        if self.stage == 0:
            time.sleep(wait_s)
            try:
                d.send(t, dst=self.rank + 1, group=self.pp_group, tag=999)
            except Exception as e:  # the receiver gave up
                return f"send: {type(e).__name__}"
            return "sent"
        try:
            d.recv(t, src=self.rank - 1, group=self.pp_group, tag=999)
            return "received"
        except Exception as e:
            return f"timeout: {e}"[:200]

    def die(self) -> None:
        os._exit(17)
