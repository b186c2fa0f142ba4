"""Training on several Macs: data parallel over MLX's own backends, started by `mlx.launch`.

    mlx.launch --hostfile macs.json --backend ring --python .venv/bin/python -m flux_klein_mlx train ... --batch-size 1

N processes, each with `--batch-size B`, train what one process trains with `--batch-size N*B`:

- every process draws the same data order (it comes from the seed), in global batches of N*B;
  process r computes a balanced, contiguous share of each global batch (`World.share`);
- the noise and the noise level of each example come from (seed, step, example index), never
  from a process's own stream (`example_draws`), so the split does not change them;
- a share's loss is weighted by (its size / the global batch's size): the shares' gradients then
  sum to the gradient of the global batch's mean loss, and `mx.distributed.all_sum` (one flat
  float32 buffer per step) sums them before clipping; every process applies the same update;
- rank 0 alone checks the work folder, reads and writes files and prints (the others end silently
  with status 1 on an error, so that a run ends with one line); at the start it sends
  its weights, AdamW moments and data position to the others (`broadcast_*`), so a resumed run
  needs its checkpoint on rank 0 only;
- a process that stops (killed, out of memory, a cable pulled) ends the collective on the others
  with "connection lost": that becomes `PeerLost`, one line that names the last good checkpoint.

One process (not launched, or `-n 1`) is the same code with a group of one: every collective is skipped.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ...errors import FluxKleinError

_TEXT_BYTES = 2048  # room for one process's error line in `agree`


class PeerLost(FluxKleinError):
    """Another process of the run stopped: the collective it was part of cannot finish."""

    def at(self, step: int, done: list[tuple[int, object]]) -> PeerLost:
        """The one line for the user: where the run stopped, and the checkpoint to resume from."""
        last = f"{done[-1][1]} (step {done[-1][0]})" if done else "none yet"
        return PeerLost(
            f"{self} at step {step}; the last good checkpoint is {last}: continue with the same "
            "mlx.launch command and --resume"
        )


def example_draws(
    seed: int, step: int, *, indices, scheme: str, shape: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """The random numbers of some examples of step `step`: (draws (B,), noise (B, L, C)), float32.

    Example `index` (micro-batch k, position j in the global batch of size G: k*G + j) takes its own
    generator seeded (seed, step, index): first the draw its noise level comes from, U(0, 1) for the
    `uniform` scheme, else N(0, 1), as `trainer.sigmas_from_draws` wants; then its noise of `shape` (L, C).
    """
    normal = scheme != "uniform"
    draws = []
    noise = []
    for index in indices:
        rng = np.random.default_rng([seed, step, index])  # numpy's SeedSequence mixes the three words
        draws.append(rng.standard_normal(dtype=np.float32) if normal else rng.random(dtype=np.float32))
        noise.append(rng.standard_normal(shape, dtype=np.float32))
    return np.array(draws, dtype=np.float32), np.stack(noise)


def check_processes(folder: Path, now: int) -> None:
    """A checkpoint continues only with the process count that wrote it (its data order and shares)."""
    try:
        before = json.loads((Path(folder) / "state.json").read_text())["run_key"]["processes"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return  # unreadable: state.checkpoint_problem says what is wrong with it
    if before != now:
        raise FluxKleinError(
            f"--resume: {folder} was trained by {before} process(es), this run has {now}; resume it with "
            f"{before} (mlx.launch -n or the hostfile), or start anew in another --work-dir"
        )


@dataclass
class World:
    """This process's place in the run: rank, number of processes, and the group (None alone)."""

    group: object | None = None  # mx.distributed.Group
    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def share(self, n: int) -> range:
        """The positions of a global batch of n examples this process computes (sizes differ by at most 1)."""
        base, extra = divmod(n, self.size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (1 if self.rank < extra else 0))

    def _evaluate(self, x: mx.array) -> None:
        """Run a collective (its inputs are already computed: an error here is the backend's)."""
        try:
            mx.eval(x)
        except RuntimeError as e:
            raise PeerLost(f"another process of this {self.size}-process run stopped ({e})") from None

    def sum_grads(self, grads, loss: float):
        """(gradient tree, loss) summed over the processes, through one float32 buffer; each leaf keeps its dtype."""
        if self.group is None:
            return grads, loss
        leaves = tree_flatten(grads)
        arrays = [v for _, v in leaves] + [mx.array([loss], dtype=mx.float32)]
        flat = mx.concatenate([a.astype(mx.float32).reshape(-1) for a in arrays])
        total = mx.distributed.all_sum(flat, group=self.group)
        self._evaluate(total)
        out = []
        k = 0
        for a in arrays:
            out.append(total[k : k + a.size].reshape(a.shape).astype(a.dtype))
            k += a.size
        return tree_unflatten([(path, v) for (path, _), v in zip(leaves, out, strict=False)]), out[-1].item()

    def broadcast_tree(self, tree):
        """Rank 0's values of `tree` on every process (the others give zeros to the sum), dtype by dtype, exact."""
        if self.group is None:
            return tree
        leaves = tree_flatten(tree)
        result = {}
        for dtype in dict.fromkeys(v.dtype for _, v in leaves):
            group = [(p, v) for p, v in leaves if v.dtype == dtype]
            flat = mx.concatenate([v.reshape(-1) for _, v in group])
            total = mx.distributed.all_sum(flat if self.is_main else mx.zeros_like(flat), group=self.group)
            self._evaluate(total)
            k = 0
            for p, v in group:
                result[p] = total[k : k + v.size].reshape(v.shape)
                k += v.size
        return tree_unflatten([(p, result[p]) for p, _ in leaves])

    def broadcast_json(self, obj):
        """Rank 0's JSON-able `obj` on every process (the others pass anything, e.g. None)."""
        if self.group is None:
            return obj
        data = json.dumps(obj).encode() if self.is_main else b""
        n = self.broadcast_tree({"n": mx.array([len(data)], dtype=mx.int32)})["n"].item()
        payload = np.frombuffer(data, dtype=np.uint8) if self.is_main else np.zeros(n, np.uint8)
        got = self.broadcast_tree({"b": mx.array(payload)})["b"]
        return json.loads(bytes(np.array(got, dtype=np.uint8)).decode())

    def share_state(self, state: dict, lora, model, optimizer) -> dict:
        """Rank 0's run state on every process: adapters, AdamW's moments (once resumed; a new run starts
        them at zero everywhere), and `state` (data position, RNG, histories), which it returns. Alone: `state`."""
        if self.group is None:
            return state
        state = self.broadcast_json(state)
        arrays = lora.arrays()  # names hold dots: sent as a list, not as a tree
        lora.load(dict(zip(arrays, self.broadcast_tree(list(arrays.values())), strict=True)), "rank 0's adapters")
        if state["step"] > 0:
            if not self.is_main:
                optimizer.init(model.trainable_parameters())
            optimizer.state = self.broadcast_tree(optimizer.state)
        return state

    def agree(self, check: Callable, key: Callable):
        """`check()` on every process, then agree: the first process's error is raised everywhere (rank 0
        says it), and so is a process that sees other settings or data (`key(result)`) than rank 0."""
        if self.group is None:
            return check()
        result = None
        error = None
        try:
            result = check()
        except FluxKleinError as e:
            error = e
        text = ("E" + str(error)) if error is not None else ("K" + fingerprint(key(result)))
        buf = np.zeros(_TEXT_BYTES, np.uint8)
        raw = text.encode()[:_TEXT_BYTES]
        buf[: len(raw)] = np.frombuffer(raw, np.uint8)
        gathered = mx.distributed.all_gather(mx.array(buf)[None], group=self.group)  # (size, _TEXT_BYTES)
        self._evaluate(gathered)
        rows = np.array(gathered, dtype=np.uint8)
        texts = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in rows]
        for rank, t in enumerate(texts):
            if t.startswith("E"):
                raise FluxKleinError(t[1:] if rank == 0 else f"process {rank} of {self.size}: {t[1:]}")
        for rank, t in enumerate(texts):
            if t != texts[0]:
                raise FluxKleinError(
                    f"process {rank} of {self.size} sees other settings or data than process 0 (another --data "
                    "folder, other images or options); give every Mac the same model, data folder and options"
                )
        return result


def world() -> World:
    """The run's processes: MLX's group when started by `mlx.launch` (ring or JACCL), else a group of one."""
    try:
        group = mx.distributed.init()  # a group of one when no backend is configured
    except RuntimeError as e:  # the ring's "Couldn't bind socket (error: 98)": its port is taken
        raise FluxKleinError(
            f"this process could not join the others ({e}); a port of the ring may be in use by another program: "
            "start mlx.launch again with another -p (--starting-port)"
        ) from None
    if group.size() == 1:
        return World()
    return World(group, group.rank(), group.size())


def fingerprint(parts) -> str:
    """A short hash of JSON-able parts (settings, data hashes) that every process must share."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]
