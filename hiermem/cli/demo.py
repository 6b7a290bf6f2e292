"""``hiermem demo``: train a small DLRM whose embedding tables do not fit the device tier.

Data (:mod:`hiermem.cli.demo_data`): the real Criteo rows in ``../shared/data/criteo-dac-head8k``
when present (``$HIERMEM_DATA`` points elsewhere), trained by epochs over ``train.csv``
with held-out log loss and AUC on ``dev.csv`` after each epoch and on ``test.csv`` at the
end; any Criteo-layout TSV with ``--criteo PATH`` (streamed); or the seeded synthetic
generator (``--synthetic``, or when the shared data is absent).  The 26 categorical
fields are hashed into tables ``table_factor`` times larger than the device tier, six of
them unbounded.  Embeddings train with row-wise Adagrad fused into the backward, rows
prefetched ``depth`` batches ahead; the dense MLPs with Adam.

A run directory holds its settings (``hiermem-demo.json``), the live store (``store/``),
checkpoints (``ckpt/step-N/`` with the store snapshot ``emb/`` and ``dense.pt``;
``ckpt/LATEST`` names the last complete one; the last ``keep_checkpoints`` are kept) and
a PNG of the run (``demo.png``).  Every directory is 0700, every file 0600.  A new run
never replaces an old one unless ``fresh``: it takes the next free ``PATH-2``, ``PATH-3``.
``resume`` continues from the last checkpoint with the run's saved settings, sees exactly
the batches it would have seen, and refuses a flag that contradicts them.  SIGINT or
SIGTERM stops after the current step with a checkpoint.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .demo_data import REAL, SYNTHETIC, Source, auc, choose, log_loss
from ..nn.dlrm import DLRM, criteo_features, criteo_tables
from ..errors import HierMemError
from ..core.policies import resolve_policy
from ..nn.modules import CachedEmbeddingBagCollection
from ..dataplane.optim import RowWiseAdagrad
from ..nn.pipeline import PrefetchPipeline
from ..store.hierarchical import HierarchicalStore
from ..types import StoreConfig, default_device

_MARK = "hiermem-demo.json"
#: Settings saved with a run and restored by ``resume``; a flag contradicting one is refused.
RUN_KEYS = ("data", "batch", "dim", "device_rows", "host_rows", "table_factor", "depth", "policy", "lr",
            "dense_lr", "seed")
#: Defaults of the run settings, per data source (the real rows get tiers smaller than
#: their ~34k distinct rows, so that every tier serves lookups).
DEFAULTS = {
    REAL: {"batch": 256, "dim": 16, "device_rows": 4096, "host_rows": 12288, "table_factor": 10, "depth": 2,
           "policy": "lru", "lr": 0.003, "dense_lr": 1e-3, "seed": 0},  # slower rates: 7,200 rows overfit fast
    "other": {"batch": 256, "dim": 16, "device_rows": 16384, "host_rows": 65536, "table_factor": 10, "depth": 2,
              "policy": "lru", "lr": 0.05, "dense_lr": 3e-3, "seed": 0},
}
DEFAULT_EPOCHS = 3
DEFAULT_STEPS = 300
_FLAG = {"data": "--synthetic/--criteo", "lr": "--lr", "dense_lr": "--dense-lr"}


@dataclass(frozen=True)
class DemoConfig:
    """The demo's options.  ``None`` run settings take the data source's defaults (or, with
    ``resume``, the run's saved values)."""

    steps: int | None = None  # train until this step (default: 3 epochs of real data, else 300)
    epochs: int | None = None  # train until this epoch (real data only)
    batch: int | None = None
    dim: int | None = None
    device_rows: int | None = None
    host_rows: int | None = None
    table_factor: int | None = None  # bounded tables are declared this many times the device tier
    depth: int | None = None  # prefetch depth (0: no prefetch)
    policy: str | None = None
    lr: float | None = None  # row-wise Adagrad on the embeddings
    dense_lr: float | None = None  # Adam on the MLPs
    seed: int | None = None
    synthetic: bool = False
    criteo: str | None = None
    checkpoint_every: int | None = None  # default: every epoch of the real data, else every 100 steps
    keep_checkpoints: int = 2
    device: str | None = None
    path: str = "runs/demo"
    resume: bool = False
    fresh: bool = False
    progress: bool = True
    log_every: int = 25  # without progress: a line every this many steps
    png: bool = True


class Interrupted(Exception):
    """The demo stopped on SIGINT/SIGTERM after checkpointing; ``code`` is the exit status."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.code = 128 + signum


# -- run directory and settings -------------------------------------------------------------
def _private_write(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file created 0600 (replacing ``path`` atomically), synced."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _mkdir_private(d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(d, 0o700)


def saved_settings(run: Path) -> dict:
    f = run / _MARK
    if not f.is_file():
        raise HierMemError(f"{run}: no demo run to resume (start one with `hiermem demo --path {run}`)")
    raw = json.loads(f.read_text())
    s = raw.get("settings", raw)  # runs made before settings were saved kept asdict(cfg)
    if "data" not in s:
        s = {**s, "data": choose(bool(s.get("synthetic")), s.get("criteo"))}
    return {k: s[k] for k in RUN_KEYS if k in s}


def _given(cfg: DemoConfig) -> dict:
    """The run settings the caller set explicitly (``None`` means "not given")."""
    out = {k: getattr(cfg, k) for k in RUN_KEYS if k != "data" and getattr(cfg, k) is not None}
    if cfg.synthetic or cfg.criteo:
        out["data"] = choose(cfg.synthetic, cfg.criteo)
    return out


def settle(cfg: DemoConfig, run: Path) -> dict:
    """The run's settings: saved ones on resume (a contradicting flag is an error), else
    the given ones over the data source's defaults."""
    given = _given(cfg)
    if cfg.resume:
        saved = saved_settings(run)
        for k, v in given.items():
            if k in saved and saved[k] != v:
                flag = _FLAG.get(k, "--" + k.replace("_", "-"))
                raise HierMemError(f"{flag} {v} conflicts with the run in {run}, made with {k} = {saved[k]}: "
                                   f"drop {flag} to resume it, or start a new run (--fresh or another --path)")
        base = DEFAULTS[REAL if saved.get("data") == REAL else "other"]
        return {**base, **saved}
    data = given.get("data") or choose(False, None)
    return {**DEFAULTS[REAL if data == REAL else "other"], **given, "data": data}


def _check(s: dict, cfg: DemoConfig) -> None:
    """Refuse bad settings before anything is created, naming the flag."""
    for k in ("batch", "dim", "device_rows", "table_factor"):
        if not isinstance(s[k], int) or s[k] <= 0:
            raise HierMemError(f"--{k.replace('_', '-')} must be a positive integer, got {s[k]}")
    for k in ("host_rows", "depth"):
        if not isinstance(s[k], int) or s[k] < 0:
            raise HierMemError(f"--{k.replace('_', '-')} must be >= 0, got {s[k]}")
    if cfg.keep_checkpoints < 1:
        raise HierMemError(f"--keep-checkpoints must be >= 1, got {cfg.keep_checkpoints}")
    if cfg.epochs is not None and s["data"] != REAL:
        raise HierMemError(f"--epochs needs the real Criteo splits; this run's data is {s['data']}: use --steps")
    if cfg.fresh and cfg.resume:
        raise HierMemError("--fresh and --resume contradict each other")
    resolve_policy(s["policy"])  # raises PolicyFileError / ValueError naming the policy


def _is_run(d: Path) -> bool:
    return (d / _MARK).is_file()


def run_dir(cfg: DemoConfig, out) -> Path:
    """The directory this run writes: never an old run's unless ``fresh`` (or ``resume``)."""
    run = Path(cfg.path)
    if cfg.resume or not run.exists() or not any(run.iterdir()):
        return run
    if not _is_run(run):
        raise HierMemError(f"{run}: exists and is not a hiermem demo run directory (pick another --path)")
    if cfg.fresh:
        shutil.rmtree(run)
        print(f"hiermem demo: --fresh: removed the earlier run in {run}", file=out)
        return run
    k = 2
    while Path(f"{run}-{k}").exists():
        k += 1
    new = Path(f"{run}-{k}")
    print(f"hiermem demo: {run} holds an earlier run (kept; `--resume` continues it, `--fresh` replaces it); "
          f"this run writes {new}", file=out)
    return new


# -- checkpoints -----------------------------------------------------------------------------
def _exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries atomically (Linux ``renameat2(RENAME_EXCHANGE)``)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _step_of(name: str) -> int:
    return int(name.split("-", 1)[1])


def save_checkpoint(run: Path, step: int, emb, model, opt, history: dict, keep: int) -> Path:
    """Write ``ckpt/step-N`` complete or not at all, point ``LATEST`` at it, keep the last ``keep``.

    A checkpoint of a step that already exists replaces it by an atomic exchange: there is
    never a moment without a complete ``step-N``."""
    ck = run / "ckpt"
    _mkdir_private(ck)
    final, tmp = ck / f"step-{step:07d}", ck / f".step-{step:07d}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700)
    emb.checkpoint(tmp / "emb")
    dense = {k: v.detach().clone() for k, v in model.named_parameters() if not k.startswith("embeddings.")}
    fd = os.open(tmp / "dense.pt", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        torch.save({"step": step, "dense": dense, "opt": opt.state_dict(),
                    **{k: torch.tensor(v, dtype=torch.float64) for k, v in history.items()}}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(tmp)
    if final.exists() and _exchange(tmp, final):
        shutil.rmtree(tmp)  # now the old copy
    else:
        if final.exists():  # no atomic exchange on this filesystem: the old copy goes first
            shutil.rmtree(final)
        os.rename(tmp, final)
    _private_write(ck / "LATEST", (final.name + "\n").encode())
    _fsync_dir(ck)
    prune_checkpoints(ck, keep)
    return final


def prune_checkpoints(ck: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` ``step-N`` directories (never the one ``LATEST`` names)."""
    latest = (ck / "LATEST").read_text().strip() if (ck / "LATEST").is_file() else None
    steps = sorted((d for d in ck.glob("step-*") if d.is_dir()), key=lambda d: _step_of(d.name))
    gone = [d for d in steps[:-keep] if d.name != latest] if keep > 0 else []
    for d in gone:
        shutil.rmtree(d)
    return gone


def latest_checkpoint(run: Path) -> Path | None:
    f = run / "ckpt" / "LATEST"
    return run / "ckpt" / f.read_text().strip() if f.is_file() else None


# -- model -----------------------------------------------------------------------------------
def build(s: dict, run: Path, device: str, resume: bool):
    """The model, its embedding collection, the dense optimizer and the saved history."""
    tables = criteo_tables(s["table_factor"] * s["device_rows"], s["dim"])
    start, history, state = 0, {}, None
    if resume and latest_checkpoint(run) is not None:
        ck = latest_checkpoint(run)
        store = HierarchicalStore.restore(ck / "emb", run / "store", device=device, device_rows=s["device_rows"],
                                          host_rows=s["host_rows"], policy=s["policy"])
        emb = CachedEmbeddingBagCollection(tables, store=store)
        state = torch.load(ck / "dense.pt", weights_only=True)
        start = int(state["step"])
        history = {k: v.tolist() for k, v in state.items() if k not in ("step", "dense", "opt")}
    else:
        shutil.rmtree(run / "store", ignore_errors=True)  # a run killed before its first checkpoint
        emb = CachedEmbeddingBagCollection(tables, StoreConfig(
            path=run / "store", device=device, device_rows=s["device_rows"], host_rows=s["host_rows"],
            policy=s["policy"], optimizer=RowWiseAdagrad(lr=s["lr"]), seed=s["seed"]))
    torch.manual_seed(s["seed"])
    model = DLRM(emb, len(tables), s["dim"])
    opt = torch.optim.Adam(model.dense_parameters(), lr=s["dense_lr"])
    if state is not None:
        with torch.no_grad():
            for k, p in model.named_parameters():
                if k in state["dense"]:
                    p.copy_(state["dense"][k])
        opt.load_state_dict(state["opt"])
    return tables, emb, model, opt, start, history


# -- signals ---------------------------------------------------------------------------------
class _Stop:
    """SIGINT/SIGTERM: the first asks the loop to stop after its step (with a checkpoint);
    a second one interrupts at once."""

    def __init__(self, err):
        self.signum: int | None = None
        self.err = err
        self.old: dict = {}

    def __enter__(self) -> "_Stop":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        print(f"\nhiermem demo: {signal.Signals(signum).name}: stopping after this step to checkpoint "
              "(again to quit at once)", file=self.err, flush=True)

    def __exit__(self, *exc) -> None:
        for sig, h in self.old.items():
            signal.signal(sig, h)


# -- the run ---------------------------------------------------------------------------------
def _target(cfg: DemoConfig, src: Source) -> int:
    spe = src.steps_per_epoch
    if cfg.steps is not None:
        return cfg.steps
    if spe is not None:
        return (cfg.epochs if cfg.epochs is not None else DEFAULT_EPOCHS) * spe
    return DEFAULT_STEPS


def evaluate(model, src: Source, split: str, tables, salt: int, device: str) -> dict | None:
    """Held-out log loss and AUC of ``split`` (its rows go through the same tiers)."""
    parts = src.held_out(split)
    if parts is None:
        return None
    ys, ps = [], []
    with torch.no_grad():
        for labels, dense, cats in parts:
            logits = model(torch.from_numpy(dense).to(device), criteo_features(cats, tables, salt=salt))
            ps.append(torch.sigmoid(logits).float().cpu().numpy().reshape(-1))
            ys.append(labels)
    y, p = np.concatenate(ys), np.concatenate(ps)
    return {"rows": len(y), "log_loss": round(log_loss(y, p), 4), "auc": round(auc(y, p), 4)}


def _tier_counts(emb) -> np.ndarray:
    """``[3 tiers, (lookups, hits)]`` summed over tables (this session's counters)."""
    t = emb.store.counters.table.sum(0)
    return t[:, :2].numpy().copy()


def _progress(cfg: DemoConfig, step: int, start: int, target: int, loss: float, err) -> None:
    n = target - start
    if cfg.progress:
        if step % 5 == 0 or step == target:
            done = int(30 * (step - start) / max(1, n))
            print(f"\r[{'#' * done}{'.' * (30 - done)}] step {step}/{target} loss {loss:.4f}",
                  end="", file=err, flush=True)
    elif cfg.log_every and ((step - start) % cfg.log_every == 0 or step == target):
        print(f"hiermem demo: step {step}/{target} loss {loss:.4f}", file=err, flush=True)


def run_demo(cfg: DemoConfig, out=None, err=None) -> dict:
    """Train the DLRM (resuming from the run's last checkpoint with ``resume``).

    Raises:
        HierMemError: bad settings, a flag contradicting the resumed run's settings.
        Interrupted: SIGINT/SIGTERM arrived; the run was checkpointed first.
    """
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    s = settle(cfg, Path(cfg.path))
    _check(s, cfg)
    run = run_dir(cfg, out)
    src = Source.open(s["data"], s["batch"], s["seed"])
    target = _target(cfg, src)
    done = _done_step(run) if cfg.resume else 0
    if cfg.resume and done >= target:
        return _nothing_left(cfg, run, src, done, target, out)
    _mkdir_private(run)
    _private_write(run / _MARK, json.dumps({"settings": s}, indent=1).encode())
    device = cfg.device or default_device()
    tables, emb, model, opt, start, history = build(s, run, device, cfg.resume)
    model.to(device)
    _intro(s, src, tables, emb, run, target, start, cfg, out)
    try:
        with _Stop(err) as stop:
            summary = _train(cfg, s, src, run, device, tables, emb, model, opt, start, target, history, stop, out,
                             err)
    finally:
        emb.store.close()
    _report(summary, out)
    if summary["interrupted"]:
        raise Interrupted(summary["interrupted"], f"stopped at step {summary['end_step']}: checkpoint "
                          f"{summary['checkpoint']} (`{_resume_cmd(run)}` continues)")
    return summary


def _done_step(run: Path) -> int:
    ck = latest_checkpoint(run)
    return _step_of(ck.name) if ck is not None else 0


def _resume_cmd(run: Path) -> str:
    return "hiermem demo --resume" + ("" if str(run) == "runs/demo" else f" --path {run}")


def _nothing_left(cfg: DemoConfig, run: Path, src: Source, done: int, target: int, out) -> dict:
    spe = src.steps_per_epoch
    more = (f"--epochs {done // spe + 1} (or --steps N above {done})" if spe else f"--steps N above {done}")
    print(f"hiermem demo: {run} is at step {done}" + (f" (epoch {done / spe:g})" if spe else "")
          + f", the target of this resume is step {target}: nothing left to train. "
          f"Train further with `{_resume_cmd(run)} {more}`; start anew with --fresh.", file=out)
    return {"data": src.name, "steps": 0, "start_step": done, "end_step": done, "nothing_left": True,
            "checkpoint": str(latest_checkpoint(run))}


def _intro(s, src: Source, tables, emb, run: Path, target: int, start: int, cfg: DemoConfig, out) -> None:
    nb = sum(1 for t in tables if t.num_rows is not None)
    spe = src.steps_per_epoch
    what = (f"{src.name}: {src.train_rows:,} train rows ({spe} steps an epoch), {len(src.dev[0]):,} dev, "
            f"{len(src.test[0]):,} test" if spe else src.name)
    span = f"steps {start}..{target}" + (f" (epochs {start / spe:g}..{target / spe:g})" if spe else "")
    print(f"hiermem demo: DLRM on {what}; {len(tables)} tables of dim {s['dim']} ({len(tables) - nb} unbounded, "
          f"{nb} of {s['table_factor'] * s['device_rows']:,} rows); device tier {s['device_rows']:,} rows on "
          f"{emb.store.device}, host tier {s['host_rows']:,}, LMDB in {run / 'store'}; {span}", file=out)
    if src.name == REAL:
        distinct = _distinct_rows(src, tables, s["seed"])
        cap = s["device_rows"] + s["host_rows"]
        print(f"hiermem demo: tiers sized below the data: {distinct:,} distinct rows in train.csv against "
              f"{cap:,} device + host slots, so each epoch evicts rows to LMDB and reads them back the next: "
              f"all three tiers serve lookups", file=out)


def _distinct_rows(src: Source, tables, salt: int) -> int:
    f = criteo_features(src.train[2], tables, salt=salt)
    tid = torch.repeat_interleave(torch.arange(len(tables)), f.lengths.view(len(tables), -1).sum(1))
    return int(torch.unique(torch.stack([tid, f.values]), dim=1).shape[1])


def _train(cfg, s, src, run, device, tables, emb, model, opt, start, target, history, stop, out, err) -> dict:
    loss_fn = torch.nn.BCEWithLogitsLoss()
    salt, spe = s["seed"], src.steps_per_epoch
    losses = list(history.get("losses", []))
    tiers = list(history.get("tiers", []))  # per step: device/host/disk (lookups, hits)
    evals = list(history.get("dev", []))  # (step, log loss, auc)
    every = cfg.checkpoint_every if cfg.checkpoint_every is not None else (spe or 100)
    eval_every = spe or every
    data = ((torch.from_numpy(d).to(device), criteo_features(c, tables, salt=salt), torch.from_numpy(y).to(device))
            for y, d, c in src.batches(start))
    n = target - start
    pipe = PrefetchPipeline(_take(data, n), emb, depth=s["depth"]) if s["depth"] > 0 and n else None
    times: list[float] = []
    step, prev = start, _tier_counts(emb)
    ck = None
    try:
        for dense, feats, labels in (pipe if pipe is not None else _take(data, n)):
            t0 = time.perf_counter()
            loss = loss_fn(model(dense, feats), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
            now = _tier_counts(emb)
            tiers.append((now - prev).reshape(-1).tolist())
            prev = now
            step += 1
            _progress(cfg, step, start, target, losses[-1], err)
            if step % eval_every == 0 or step == target:
                ev = evaluate(model, src, "dev", tables, salt, device)
                if ev is not None:
                    evals.append([step, ev["log_loss"], ev["auc"]])
                    ep = f"epoch {step / spe:g}" if spe else f"step {step}"
                    print(("\n" if cfg.progress else "") + f"hiermem demo: {ep}: dev log loss {ev['log_loss']:.4f}, "
                          f"AUC {ev['auc']:.4f} ({ev['rows']} held-out rows)", file=err, flush=True)
                prev = _tier_counts(emb)  # held-out lookups are not training steps
            if stop.signum is not None:
                break
            if every and step % every == 0 and step < target:
                ck = save_checkpoint(run, step, emb, model, opt, _hist(losses, tiers, evals), cfg.keep_checkpoints)
    finally:
        if pipe is not None:
            pipe.close()
    if cfg.progress and n and stop.signum is None:
        print(file=err)
    if ck is None or _step_of(ck.name) != step:
        ck = save_checkpoint(run, step, emb, model, opt, _hist(losses, tiers, evals), cfg.keep_checkpoints)
    test = evaluate(model, src, "test", tables, salt, device) if step == target else None
    summary = _summary(s, emb, pipe, times, losses, start, step, src)
    summary.update(checkpoint=str(ck), interrupted=stop.signum, dev=evals, test=test,
                   kept=sorted(d.name for d in (run / "ckpt").glob("step-*")), keep=cfg.keep_checkpoints,
                   resume=_resume_cmd(run))
    summary["png"] = _plot(run, losses, tiers, evals, spe) if cfg.png else None
    return summary


def _hist(losses, tiers, evals) -> dict:
    return {"losses": losses, "tiers": tiers, "dev": evals}


def _take(it, n: int):
    for i, x in enumerate(it):
        if i >= n:
            return
        yield x


def _summary(s, emb, pipe, times, losses, start: int, end: int, src: Source) -> dict:
    st = emb.store.stats()
    agg = {t: {"lookups": 0, "hits": 0} for t in ("device", "host", "disk")}
    for name in emb.names:
        for t in agg:
            agg[t]["lookups"] += st[name][t]["lookups"]
            agg[t]["hits"] += st[name][t]["hits"]
    rates = {t: (a["hits"] / a["lookups"] if a["lookups"] else 0.0) for t, a in agg.items()}
    g = st["_store"]
    spe = src.steps_per_epoch
    return {"data": src.name, "steps": len(times), "start_step": start, "end_step": end, "batch": s["batch"],
            "epochs": round(end / spe, 3) if spe else None,
            **{f"{t}_hit_rate": round(r, 4) for t, r in rates.items()},
            **{f"{t}_hits": a["hits"] for t, a in agg.items()},
            "step_ms_median": round(1e3 * statistics.median(times), 3) if times else None,
            "samples_per_s": round(s["batch"] * len(times) / sum(times), 1) if times else None,
            "loss_first": losses[start] if len(losses) > start else None,
            "loss_last": losses[-1] if losses else None, "losses": len(losses),
            "prefetch": pipe.stats() if pipe is not None else None,
            "disk_rows": g["disk_rows"], "device_rows": g["device_capacity"], "host_rows": g["host_capacity"]}


def _plot(run: Path, losses, tiers, evals, spe) -> str | None:
    """``run/demo.png``: training loss (and dev log loss) and per-tier hit rates over steps."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    x = np.arange(1, len(losses) + 1)
    a.plot(x, losses, lw=0.8, color="tab:blue", label="training loss (batch)")
    if evals:
        e = np.asarray(evals)
        a.plot(e[:, 0], e[:, 1], "o-", color="tab:red", label="dev log loss")
    a.set_ylabel("log loss")
    a.legend()
    if tiers:
        t = np.asarray(tiers, dtype=np.float64).reshape(-1, 3, 2)
        k = min(len(t), max(6, len(t) // 25))  # prefetched batches are counted when prefetched: smooth
        xs = np.arange(len(losses) - len(t), len(losses)) + 1
        for i, (name, col) in enumerate(zip(("device", "host", "disk"), ("tab:green", "tab:orange", "tab:purple"))):
            look = np.convolve(t[:, i, 0], np.ones(k), "same")
            hit = np.convolve(t[:, i, 1], np.ones(k), "same")
            b.plot(xs, np.divide(hit, look, out=np.full_like(hit, np.nan), where=look > 0), color=col,
                   label=f"{name} (of the tier's lookups)")
    b.set_ylabel(f"hit rate ({k if tiers else 1}-step window)")
    b.set_ylim(0, 1.02)
    b.set_xlabel("step" + (f" ({spe} per epoch)" if spe else ""))
    b.legend(loc="lower right")
    fig.tight_layout()
    png = run / "demo.png"
    tmp = run / f".demo.png.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fig.savefig(fh, format="png", dpi=100)
    plt.close(fig)
    os.replace(tmp, png)
    return str(png)


def _spark(xs: list[float]) -> str:
    ticks = "▁▂▃▄▅▆▇█"
    lo, hi = min(xs), max(xs)
    return "".join(ticks[int((x - lo) / (hi - lo + 1e-12) * (len(ticks) - 1))] for x in xs)


def _report(s: dict, out) -> None:
    print(f"hit rates: device {s['device_hit_rate']:.3f} | host (of device misses) {s['host_hit_rate']:.3f} | "
          f"disk (of host misses) {s['disk_hit_rate']:.3f}  ({s['device_hits']:,} / {s['host_hits']:,} / "
          f"{s['disk_hits']:,} lookups served by each tier; disk = read back from LMDB)", file=out)
    p = s["prefetch"]
    if p:
        print(f"prefetch: depth {p['depth']}, { {'threads': 'background threads', 'inline': 'inline', 'foreground': 'off'}[p['mode']]} "
              f"({p['background_reason']}), {p['prefetched_batches']} batches, {p['prefetched_rows']} rows "
              f"brought up, {p['prefetch_hits']} ids served by prefetched rows, {p['late_batches']} late, "
              f"{p['prefetch_degraded']} degraded, effective depth min {p['min_effective_depth']} "
              f"mean {p['mean_effective_depth']:.2f}, waited {p['wait_seconds']:.2f} s", file=out)
    if s["steps"]:
        print(f"step time: median {s['step_ms_median']:.2f} ms, {s['samples_per_s']:.0f} samples/s", file=out)
    print(f"loss: {s['loss_first'] or 0:.4f} -> {s['loss_last'] or 0:.4f} (training batches, steps "
          f"{s['start_step']}..{s['end_step']})", file=out)
    for step, ll, a in s["dev"][-3:]:
        print(f"dev (held out) at step {int(step)}: log loss {ll:.4f}, AUC {a:.4f}", file=out)
    if s["test"]:
        print(f"test (held out): log loss {s['test']['log_loss']:.4f}, AUC {s['test']['auc']:.4f} "
              f"({s['test']['rows']} rows)", file=out)
    elif s["data"].startswith("criteo:"):
        print("held out: none for a --criteo file (train/dev/test splits come with the shared data)", file=out)
    print(f"checkpoint: {s['checkpoint']} (`{s['resume']}` continues); keeping the last {s['keep']} "
          f"(--keep-checkpoints): {', '.join(s['kept'])}", file=out)
    if s["png"]:
        print(f"plot: {s['png']} (loss and per-tier hit rates over steps)", file=out)
    else:
        print("plot: none (pip install matplotlib for demo.png)", file=out)
    print(json.dumps(s), file=out)

