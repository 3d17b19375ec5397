"""The one opt-out flag: ROUTER_NO_EXTENSIONS=1 runs the pure-Python twins instead of compiled code."""

import os

NO_EXTENSIONS: bool = os.environ.get("ROUTER_NO_EXTENSIONS", "").strip().lower() not in (
    "",
    "0",
    "false",
    "no",
)
