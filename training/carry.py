"""Carry a training run from one GPU machine to the next: `python -m training.pipeline pack` and `unpack`.

A machine is lent for bounded calls and starts bare; one call brings back a few files of bounded size, and the next
call carries files in beside the repository, within a bound of its own. `pack` writes a workdir's state as files
within those bounds; `unpack` puts them into a workdir, where `generate` skips the shards it finds and `train`
continues the state.

Sections (--what):
  train    train/train_state.pt (the head's weights in float32, AdamW's moments in bfloat16 by default or in float32,
           the step, the epoch and the position in it, the elapsed training time, the samples, the config with the
           schedule's total) and train/train_log.jsonl, as one torch.save blob
  gen      gen/gen-KKKKK.npz (token ids as uint16, each shard's arrays compressed) and gen/DONE, as one tar
  prompts  the prompt files (train_prompts.jsonl, prompts_manifest.json, the eval sets), gzip-compressed, as one tar
Each section's blob is cut into parts of PackLimits.unit bytes at most; the parts are laid out in call folders
OUT/1, OUT/2, ..., each within one call's limits (files, bytes) and holding a copy of manifest.json: every part's size
and sha256, each blob's, and each member's content digest. `unpack --from DIR...` looks for every part in the given
folders and one folder below them, checks sizes and sha256s, and refuses a missing part (FileNotFoundError) or an
altered one (ValueError) before it writes anything.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import math
import re
import tarfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from training.generate import GEN_DIR, write_shard
from training.prompts import EVAL_FILES, TRAIN_FILE
from training.prompts import MANIFEST as PROMPTS_MANIFEST
from training.train import LOG_FILE, STATE_FILE, read_state, write_state

log = logging.getLogger(__name__)

MiB = 2**20
MANIFEST = "manifest.json"
FORMAT = "specdec-training-carry/1"
SECTIONS = ("train", "gen", "prompts")
MOMENTS = {"bfloat16": torch.bfloat16, "float32": torch.float32}  # the first is pack's default
MOMENT_KEYS = ("exp_avg", "exp_avg_sq")  # AdamW's per-parameter moments (its "step" stays as it is)
MANIFEST_RESERVE = 1 * MiB  # room a call folder keeps for its copy of the manifest
GEN_MEMBER = re.compile(rf"{GEN_DIR}/(gen-\d{{5}}\.npz|DONE)")  # the names generate.shard_path writes
PROMPT_FILES = (TRAIN_FILE, PROMPTS_MANIFEST, *EVAL_FILES.values())


@dataclass(frozen=True)
class PackLimits:
    """One call's bounds: what it brings back from the machine ($OUT) and what the next carries in."""

    max_file_bytes: int = 16 * MiB  # one file
    max_files: int = 8  # files in one call folder, its copy of the manifest included
    max_call_bytes: int = 40 * MiB  # one call folder (carried in beside the repository within the call's 64 MiB)

    def __post_init__(self) -> None:
        if self.max_file_bytes < 1:
            raise ValueError(f"max_file_bytes must be >= 1, got {self.max_file_bytes}")
        if self.max_files < 2:
            raise ValueError(f"max_files must be >= 2 (a part and the manifest), got {self.max_files}")
        if self.max_call_bytes <= MANIFEST_RESERVE:
            raise ValueError(f"max_call_bytes must exceed the manifest's reserve {MANIFEST_RESERVE}")

    @property
    def unit(self) -> int:
        """Bytes of a part: a call folder's room (less the manifest's reserve) split into equal parts of at most
        max_file_bytes, at most max_files - 1 of them. Example: 40 MiB folders, 16 MiB files -> 3 parts of 13 MiB."""
        room = self.max_call_bytes - MANIFEST_RESERVE
        per_call = min(self.max_files - 1, math.ceil(room / self.max_file_bytes))
        return min(self.max_file_bytes, room // per_call)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def cast_moments(opt_state: dict, dtype: torch.dtype) -> dict:
    """An optimizer state_dict with AdamW's moments (MOMENT_KEYS) cast to dtype; the rest as it is."""
    state = {
        i: {k: v.to(dtype) if k in MOMENT_KEYS else v for k, v in per_param.items()}
        for i, per_param in opt_state["state"].items()
    }
    return {**opt_state, "state": state}


# ---- sections ----
def pack_train(workdir: Path, moments: str) -> tuple[bytes, dict]:
    """The training state with its moments in `moments` and the training log, as one torch.save blob."""
    if moments not in MOMENTS:
        raise ValueError(f"moments must be one of {', '.join(MOMENTS)}, got {moments!r}")
    path = workdir / "train" / STATE_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path}: no training state to pack (run the train stage first)")
    st = read_state(path)
    st["opt"] = cast_moments(st["opt"], MOMENTS[moments])
    log_path = workdir / "train" / LOG_FILE
    st["train_log"] = log_path.read_text() if log_path.exists() else ""
    st["moments_dtype"] = moments
    buf = io.BytesIO()
    torch.save(st, buf)
    cfg = st.get("config", {})
    info = {
        "step": st["step"],
        "epoch": st["epoch"],
        "pos": st["pos"],
        "elapsed_min": round(st["elapsed"] / 60, 3),
        "samples": st.get("samples", 0),
        "total": {"minutes": cfg["minutes"]} if cfg.get("minutes") is not None else {"steps": cfg.get("steps")},
        "parameters": sum(v.numel() for v in st["head"].values() if v.is_floating_point()),
        "moments": moments,
    }
    return buf.getvalue(), info


def unpack_train(workdir: Path, blob: bytes, info: dict) -> None:
    """train/train_state.pt (moments back in float32) and train/train_log.jsonl. A state already there must be at
    the pack's step (it is replaced), else ValueError: a later state is never overwritten by an earlier one."""
    st = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    train_log = st.pop("train_log", "")
    st.pop("moments_dtype", None)
    st["opt"] = cast_moments(st["opt"], torch.float32)
    tdir = workdir / "train"
    tdir.mkdir(parents=True, exist_ok=True)
    path = tdir / STATE_FILE
    if path.exists():
        step = read_state(path)["step"]
        if step != st["step"]:
            raise ValueError(
                f"{path} holds a state at step {step}, the pack one at step {st['step']}: unpack into another "
                "workdir, or remove that state first"
            )
    write_state(path, st)
    (tdir / LOG_FILE).write_text(train_log)
    log.info(
        "unpack: training state at step %d (%.1f min trained, moments stored in %s)",
        st["step"],
        st["elapsed"] / 60,
        info.get("moments"),
    )


def shard_digest(arrays: dict[str, np.ndarray]) -> str:
    """sha256 of a shard's arrays: names, dtypes, shapes and bytes."""
    h = hashlib.sha256()
    for k in sorted(arrays):
        a = np.ascontiguousarray(arrays[k])
        h.update(f"{k}:{a.dtype.str}:{a.shape};".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def compact_shard(path: Path) -> tuple[bytes, dict]:
    """A shard's arrays with its token ids as uint16, compressed (np.savez_compressed); and what restores it."""
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    tokens = arrays["tokens"]  # [total]
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= 2**16):
        raise ValueError(f"{path}: token ids outside [0, 65536) do not fit uint16")
    buf = io.BytesIO()
    np.savez_compressed(buf, **{**arrays, "tokens": tokens.astype(np.uint16)})
    info = {
        "rows": len(arrays["prompt_len"]),
        "tokens": int(tokens.size),
        "sampled": int((arrays["temperature"] > 0).sum()) if "temperature" in arrays else 0,
        "tokens_dtype": tokens.dtype.str,
        "digest": shard_digest(arrays),
    }
    return buf.getvalue(), info


def restore_shard(data: bytes, info: dict) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(data)) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["tokens"] = arrays["tokens"].astype(np.dtype(info["tokens_dtype"]))
    return arrays


def _tar(members: list[tuple[str, bytes]]) -> bytes:
    """An uncompressed tar of (name, bytes), the same bytes for the same members (no times, no owners)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode, ti.mtime = len(data), 0o644, 0
            tar.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def _untar(blob: bytes) -> dict[str, bytes]:
    out = {}
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tar:
        for m in tar.getmembers():
            f = tar.extractfile(m) if m.isfile() else None
            if f is None:
                raise ValueError(f"pack member {m.name!r} is not a plain file")
            out[m.name] = f.read()
    return out


def pack_gen(workdir: Path) -> tuple[bytes, dict]:
    """gen/gen-*.npz (compacted) and gen/DONE as one tar."""
    gdir = workdir / GEN_DIR
    shards = sorted(p for p in gdir.glob("gen-*.npz") if ".tmp" not in p.name)
    if not shards:
        raise FileNotFoundError(f"no generated shards in {gdir} to pack (run the generate stage first)")
    members, infos = [], {}
    for p in shards:
        data, info = compact_shard(p)
        members.append((f"{GEN_DIR}/{p.name}", data))
        infos[f"{GEN_DIR}/{p.name}"] = info
    if (gdir / "DONE").exists():
        done = (gdir / "DONE").read_bytes()
        members.append((f"{GEN_DIR}/DONE", done))
        infos[f"{GEN_DIR}/DONE"] = {"sha256": sha256(done)}
    rows = sum(i.get("rows", 0) for i in infos.values())
    tokens = sum(i.get("tokens", 0) for i in infos.values())
    sampled = sum(i.get("sampled", 0) for i in infos.values())
    return _tar(members), {"shards": len(shards), "rows": rows, "tokens": tokens, "sampled": sampled, "members": infos}


def _write_new(path: Path, data: bytes) -> None:
    """Write path atomically; a file already there must hold the same bytes (ValueError otherwise)."""
    if path.exists():
        if path.read_bytes() != data:
            raise ValueError(f"{path} exists with other content than the pack's: remove it or unpack elsewhere")
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def unpack_gen(workdir: Path, blob: bytes, info: dict) -> None:
    """The shards (token ids back in their dtype, each checked against its digest) and gen/DONE. A shard or DONE
    already there is kept when it holds the same arrays or bytes, else ValueError."""
    members = _untar(blob)
    expected = info["members"]
    if set(members) != set(expected):
        raise ValueError(f"the gen tar holds {sorted(members)}, its manifest lists {sorted(expected)}")
    gdir = workdir / GEN_DIR
    gdir.mkdir(parents=True, exist_ok=True)
    for name, data in members.items():
        m = GEN_MEMBER.fullmatch(name)
        if m is None:
            raise ValueError(f"unexpected member {name!r} in the gen tar")
        target = gdir / m.group(1)
        if m.group(1) == "DONE":
            if sha256(data) != expected[name]["sha256"]:
                raise ValueError(f"{name} in the pack differs from its manifest's sha256")
            _write_new(target, data)  # a DONE already there with other settings is refused, as a shard is
            continue
        arrays = restore_shard(data, expected[name])
        if shard_digest(arrays) != expected[name]["digest"]:
            raise ValueError(f"{name} restored from the pack differs from the shard that was packed")
        if target.exists():
            with np.load(target) as z:
                if shard_digest({k: z[k] for k in z.files}) != expected[name]["digest"]:
                    raise ValueError(f"{target} exists with other responses than the pack's: remove it first")
            continue
        write_shard(target, arrays)
    log.info("unpack: %d shards, %d responses, %d tokens in %s", info["shards"], info["rows"], info["tokens"], gdir)


def pack_prompts(workdir: Path) -> tuple[bytes, dict]:
    """The prompt files present (train_prompts.jsonl required), each gzip-compressed, as one tar."""
    if not (workdir / TRAIN_FILE).exists():
        raise FileNotFoundError(f"{workdir / TRAIN_FILE}: no prompt files to pack (run the prompts stage first)")
    members, infos = [], {}
    for name in PROMPT_FILES:
        if (workdir / name).exists():
            data = (workdir / name).read_bytes()
            members.append((name + ".gz", gzip.compress(data, mtime=0)))
            infos[name] = {"bytes": len(data), "sha256": sha256(data)}
    return _tar(members), {"members": infos}


def unpack_prompts(workdir: Path, blob: bytes, info: dict) -> None:
    """The prompt files; one already there must hold the same bytes (ValueError otherwise)."""
    members = _untar(blob)
    expected = info["members"]
    if {n.removesuffix(".gz") for n in members} != set(expected) or not all(n.endswith(".gz") for n in members):
        raise ValueError(f"the prompts tar holds {sorted(members)}, its manifest lists {sorted(expected)}")
    workdir.mkdir(parents=True, exist_ok=True)
    for gz, data in members.items():
        name = gz.removesuffix(".gz")
        if name not in PROMPT_FILES:
            raise ValueError(f"unexpected member {gz!r} in the prompts tar")
        raw = gzip.decompress(data)
        if sha256(raw) != expected[name]["sha256"]:
            raise ValueError(f"{name} in the pack differs from its manifest's sha256")
        _write_new(workdir / name, raw)
    log.info("unpack: prompt files %s", ", ".join(expected))


# ---- pack / unpack ----
def sections_of(what: str, workdir: Path) -> tuple[str, ...]:
    """--what: "all" (every section the workdir has) or a comma-separated list of SECTIONS."""
    if what == "all":
        present = {
            "train": (workdir / "train" / STATE_FILE).exists(),
            "gen": any((workdir / GEN_DIR).glob("gen-*.npz")),
            "prompts": (workdir / TRAIN_FILE).exists(),
        }
        found = tuple(s for s in SECTIONS if present[s])
        if not found:
            raise FileNotFoundError(f"{workdir} holds no training state, generated shards or prompt files to pack")
        return found
    names = tuple(s.strip() for s in what.split(",") if s.strip())
    bad = [s for s in names if s not in SECTIONS]
    if bad or not names:
        raise ValueError(f"--what {what!r}: give all or some of {', '.join(SECTIONS)}, comma-separated")
    return names


def pack(
    workdir: Path, out: Path, what: str = "all", limits: PackLimits | None = None, moments: str = next(iter(MOMENTS))
) -> dict:
    """Pack the workdir's sections (sections_of(what)) into call folders out/1, out/2, ... (see the module's
    docstring); out must be empty or absent. Returns the manifest."""
    limits = limits or PackLimits()
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty: pack into an empty folder")
    sections, files, folders = {}, {}, [[]]
    unit = limits.unit
    used = 0
    for section in sections_of(what, workdir):
        blob, info = pack_train(workdir, moments) if section == "train" else PACKERS[section](workdir)
        parts = []
        for i, start in enumerate(range(0, max(len(blob), 1), unit)):
            data = blob[start : start + unit]
            name = f"{section}-{i:03d}.part"
            if len(folders[-1]) >= limits.max_files - 1 or used + len(data) > limits.max_call_bytes - MANIFEST_RESERVE:
                folders.append([])
                used = 0
            folders[-1].append(name)
            used += len(data)
            files[name] = {"folder": len(folders), "bytes": len(data), "sha256": sha256(data)}
            (out / str(len(folders))).mkdir(parents=True, exist_ok=True)
            (out / str(len(folders)) / name).write_bytes(data)
            parts.append(name)
        sections[section] = {"parts": parts, "bytes": len(blob), "sha256": sha256(blob), **info}
        log.info("pack: %s, %d bytes in %d parts", section, len(blob), len(parts))
    manifest = {
        "format": FORMAT,
        "limits": asdict(limits) | {"unit": unit},
        "sections": sections,
        "files": files,
        "folders": folders,
    }
    text = json.dumps(manifest, indent=1) + "\n"
    if len(text.encode()) > MANIFEST_RESERVE:
        raise ValueError(f"the manifest ({len(text.encode())} bytes) exceeds its reserve {MANIFEST_RESERVE}")
    for k in range(1, len(folders) + 1):
        (out / str(k) / MANIFEST).write_text(text)
    log.info("pack: %d files in %d call folders under %s", len(files), len(folders), out)
    return manifest


PACKERS = {"gen": pack_gen, "prompts": pack_prompts}
UNPACKERS = {"train": unpack_train, "gen": unpack_gen, "prompts": unpack_prompts}


def _candidates(name: str, sources: list[Path]) -> list[Path]:
    """name in each source folder and in each folder directly below one."""
    out = []
    for d in sources:
        out.append(d / name)
        if d.is_dir():
            out += [c / name for c in sorted(d.iterdir()) if c.is_dir()]
    return [p for p in out if p.is_file()]


def read_manifest(sources: list[Path]) -> dict:
    """The pack's manifest (its copies in the sources must agree)."""
    missing = [str(d) for d in sources if not d.is_dir()]
    if missing:
        raise FileNotFoundError(f"no folder {', '.join(missing)}")
    found = _candidates(MANIFEST, sources)
    if not found:
        raise FileNotFoundError(f"no {MANIFEST} in {', '.join(map(str, sources))} nor in a folder below them")
    manifests = [json.loads(p.read_text()) for p in found]
    if any(m != manifests[0] for m in manifests[1:]):
        raise ValueError(f"the manifests in {', '.join(map(str, found))} differ: give the folders of one pack")
    if manifests[0].get("format") != FORMAT:
        raise ValueError(f"{found[0]} is not a {FORMAT} manifest")
    return manifests[0]


def unpack(workdir: Path, sources: list[Path], what: str | None = None) -> dict:
    """Check every part of the chosen sections (default: all the pack holds) in the sources, then write them
    into the workdir. FileNotFoundError names a missing part and its call folder; ValueError an altered one.
    Returns the manifest."""
    manifest = read_manifest(sources)
    sections = tuple(manifest["sections"]) if what in (None, "all") else sections_of(what, workdir)
    absent = [s for s in sections if s not in manifest["sections"]]
    if absent:
        raise ValueError(f"the pack holds {', '.join(manifest['sections'])}, not {', '.join(absent)}")
    blobs = {}
    for section in sections:
        sec = manifest["sections"][section]
        data = bytearray()
        for name in sec["parts"]:
            entry = manifest["files"][name]
            found = _candidates(name, sources)
            if not found:
                raise FileNotFoundError(
                    f"{name} (call folder {entry['folder']} of the pack, section {section}) is in none of "
                    f"{', '.join(map(str, sources))} nor in a folder below them: carry it in"
                )
            part = found[0].read_bytes()
            if len(part) != entry["bytes"] or sha256(part) != entry["sha256"]:
                raise ValueError(
                    f"{found[0]} is altered: {len(part)} bytes, sha256 {sha256(part)[:16]}..., the manifest says "
                    f"{entry['bytes']} bytes, {entry['sha256'][:16]}...: carry it in again"
                )
            data += part
        if sha256(bytes(data)) != sec["sha256"]:
            raise ValueError(f"section {section}: its parts joined differ from the blob that was packed")
        blobs[section] = bytes(data)
    for section in sections:
        UNPACKERS[section](workdir, blobs[section], manifest["sections"][section])
    return manifest
