"""Build-time guard of the images: installed versions equal the Dockerfile's pins; forbidden ones absent.

    python docker/verify_image.py torch==2.7.1 fla-core==0.6.0 ... [--absent triton]

Runs in the Dockerfile right after the locked install, so an image whose lock and ARGs disagree, or an
NPU image that got community ``triton`` next to ``triton-ascend``, fails to build instead of failing
a day into a run.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata

from packaging.requirements import Requirement


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pins", nargs="+", help="name==version that must be installed")
    parser.add_argument("--absent", action="append", default=[], help="a distribution that must not be installed")
    ns = parser.parse_args(argv)
    problems = []
    for text in ns.pins:
        req = Requirement(text)
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{req.name}: not installed, Dockerfile pins {req.specifier}")
            continue
        if not req.specifier.contains(have, prereleases=True):
            problems.append(f"{req.name}: {have} installed, Dockerfile pins {req.specifier} (regenerate the lock)")
    for name in ns.absent:
        try:
            problems.append(f"{name} {metadata.version(name)} is installed but must not be")
        except metadata.PackageNotFoundError:
            pass
    for p in problems:
        print(f"verify_image: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
