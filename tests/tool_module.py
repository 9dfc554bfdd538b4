"""Import one of tools/' scripts as a module, by path (tools/ is not a package)."""

import importlib.util
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(relative_path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / relative_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
