"""Write a container image as a docker-archive tar (`ctr images import` reads it), without a
registry or a container build tool: one layer per root filesystem directory and one for the
loose files, a config with the entrypoint, command, environment, user and working directory.

    python oci_image.py --tag slotune.local/pause:3.2 --file /path/pause:/pause --entrypoint /pause --out pause.tar
    python oci_image.py --rootfs ROOTFS --out base.layer.tar
    python oci_image.py --tag ghcr.io/slotune/slotune:0.1.0 --layer base.layer.tar --wheel slotune.whl:/opt/venv --out slotune.tar
"""

from __future__ import annotations

import argparse
import configparser
import hashlib
import io
import json
import os
import tarfile
import tempfile
import zipfile
from pathlib import Path


def _as_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """Root-owned, dated 0: the same files make the same layer (and image digest), so an unchanged
    image is not imported again."""
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    info.mtime = 0
    return info


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def dir_layer(rootfs: Path, out: Path) -> Path:
    """A layer tar of the directory `rootfs` (owners, modes, links and device nodes as they are)."""
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(os.listdir(rootfs)):
            tar.add(rootfs / entry, arcname=entry)
    return out


def files_layer(files: list[tuple[Path, str]], out: Path) -> Path:
    """A layer tar of host files placed at the given paths (root-owned, with their parent directories)."""
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        made: set[str] = set()
        for src, dest in files:
            dest = dest.lstrip("/")
            parts = Path(dest).parent.parts
            for i in range(len(parts)):
                name = "/".join(parts[: i + 1])
                if name not in made:
                    d = tarfile.TarInfo(name)
                    d.type, d.mode = tarfile.DIRTYPE, 0o755
                    tar.addfile(_as_root(d))
                    made.add(name)
            tar.add(src, arcname=dest, filter=_as_root)
    return out


def wheel_layer(wheel: Path, venv: str, out: Path) -> Path:
    """A layer tar that installs `wheel` (no dependencies) into the image's virtual environment at
    `venv`: its files under site-packages, and a script in bin/ per console entry point."""
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / venv.lstrip("/") / "lib" / "python3.11" / "site-packages"
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
        files = [(p, "/" + str(p.relative_to(tmp))) for p in sorted(site.rglob("*")) if p.is_file()]
        eps = configparser.ConfigParser()
        eps.read(next(site.glob("*.dist-info")) / "entry_points.txt")
        for name, target in eps["console_scripts"].items() if eps.has_section("console_scripts") else []:
            module, func = target.split(":")
            script = Path(tmp) / name
            script.write_text(f"#!{venv}/bin/python\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n")
            script.chmod(0o755)
            files.append((script, f"{venv}/bin/{name}"))
        return files_layer(files, out)


def build(tag: str, out: Path, layers: list[Path], config: dict) -> None:
    """Write the image `tag` (layer tars, bottom first; `config`: Entrypoint, Cmd, Env, ...) to `out`
    as a docker-archive."""
    diff_ids = [_sha256(layer) for layer in layers]
    env = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", *config.pop("Env", [])]
    image = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": env, **config},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{d}" for d in diff_ids]},
    }
    raw = json.dumps(image, sort_keys=True).encode()
    config_name = f"{hashlib.sha256(raw).hexdigest()}.json"
    manifest = [{"Config": config_name, "RepoTags": [tag], "Layers": [f"{d}/layer.tar" for d in diff_ids]}]
    tmp_out = out.with_suffix(".tmp")
    with tarfile.open(tmp_out, "w") as tar:
        for layer, d in zip(layers, diff_ids):
            tar.add(layer, arcname=f"{d}/layer.tar", filter=_as_root)
        for name, data in ((config_name, raw), ("manifest.json", json.dumps(manifest).encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    tmp_out.rename(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tag", help="without it, --rootfs's layer alone is written to --out")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--layer", action="append", default=[], type=Path, help="a layer tar (bottom first)")
    p.add_argument("--rootfs", type=Path, help="a directory: a layer of it")
    p.add_argument("--wheel", help="WHEEL:VENV, a layer installing WHEEL (no dependencies) into VENV")
    p.add_argument("--file", action="append", default=[], help="SRC:DEST, a host file placed at DEST")
    p.add_argument("--entrypoint", action="append")
    p.add_argument("--cmd", action="append")
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE")
    p.add_argument("--workdir")
    p.add_argument("--user")
    a = p.parse_args()
    if not a.tag:
        dir_layer(a.rootfs, a.out.with_suffix(".tmp")).rename(a.out)
        return
    with tempfile.TemporaryDirectory(dir=a.out.parent) as tmp:
        layers = list(a.layer)
        if a.rootfs:
            layers.append(dir_layer(a.rootfs, Path(tmp) / "rootfs.tar"))
        if a.wheel:
            wheel, venv = a.wheel.split(":", 1)
            layers.append(wheel_layer(Path(wheel), venv, Path(tmp) / "wheel.tar"))
        if a.file:
            files = [(Path(src), dest) for src, dest in (f.split(":", 1) for f in a.file)]
            layers.append(files_layer(files, Path(tmp) / "files.tar"))
        config = {"Env": a.env, "Entrypoint": a.entrypoint, "Cmd": a.cmd, "WorkingDir": a.workdir, "User": a.user}
        build(a.tag, a.out, layers, {k: v for k, v in config.items() if v})


if __name__ == "__main__":
    main()
