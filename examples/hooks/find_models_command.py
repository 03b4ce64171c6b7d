"""A ``nanovllm find-models FOLDER`` command: the checkpoint folders under FOLDER and their architectures."""

import json
from pathlib import Path

from nanovllm_core import Command, hookimpl

NANOVLLM_PLUGIN_API = ">=2,<3"


class FindModels(Command):
    help = "list the checkpoint folders under a folder, with their architectures"

    def add_arguments(self, parser):
        parser.add_argument("folder", type=Path)

    def run(self, args):
        found = 0
        for config in sorted(args.folder.rglob("config.json")):
            architectures = json.loads(config.read_text()).get("architectures") or ["?"]
            print(f"{config.parent}  {', '.join(architectures)}")
            found += 1
        return 0 if found else 1


@hookimpl
def nanovllm_register_commands(register):
    register("find-models", FindModels)
