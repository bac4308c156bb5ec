"""What a node's venv needs from pyproject.toml, for deploy/arm/arm-root.sh (runs inside the root).

python3 node_deps.py PYPROJECT pulls-torch     # 'yes' where the plain `pip install .` still pulls torch
python3 node_deps.py PYPROJECT requirements    # the plain install's requirements but torch and ggml-python
"""

from __future__ import annotations

import re
import sys
import tomllib

OWN = ("torch", "ggml-python")  # torch: not on a node; ggml-python: the build's own wheel, installed first


def name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] not in ("pulls-torch", "requirements"):
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0], "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    if argv[1] == "pulls-torch":
        print("yes" if any(name(d) == "torch" for d in deps) else "no")
    else:
        print("\n".join(d for d in deps if name(d) not in OWN))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
