"""``nanovllm plugins``: what is installed, what each plugin registers, and what is broken."""

from __future__ import annotations

import argparse

from nanovllm_core.config import PluginsConfig
from nanovllm_core.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``nanovllm plugins`` to the command's subparsers."""
    plugins = sub.add_parser(
        "plugins",
        help="list installed plugins, what each registers, and broken ones",
        description="List every registered name with its distribution, version and module; * marks the "
        "config's selection, ! a name that two plugins register. Exits 1 when a plugin is broken, a name "
        "conflicts or a selected name is not installed (everything is listed all the same), else 0.",
    )
    plugins.add_argument("--config", help="TOML config file whose [plugins] selection is marked with *")
    plugins.set_defaults(func=cmd_plugins)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]


def cmd_plugins(args: argparse.Namespace) -> int:
    """The installed plugins, what each registers, the config's selection (``*``), the broken ones, and each role
    (scheduler, block manager, attention backend, model) that no installed plugin fills, with what to install."""
    from nanovllm_core.config import read_config_file
    from nanovllm_core.plugins import conflict_message, get_registry, missing_hint, none_installed_hint

    registry = get_registry()
    table = read_config_file(args.config).get("plugins", {}) if args.config else {}
    try:
        selection = PluginsConfig(**table)
    except ValueError as exc:
        raise ConfigError(f"[plugins] of {args.config}: {exc}") from None
    selected = {
        "scheduler": selection.scheduler,
        "block_manager": selection.block_manager,
        "attention": selection.attention,
    }
    rows = [("", "kind", "name", "distribution", "version", "module")]
    rows += [
        (
            ("*" if selected.get(r.kind) == r.name else "") + ("!" if r.name in registry.conflicts[r.kind] else ""),
            r.kind, r.name, r.distribution, r.version, r.module,
        )
        for r in registry.all()
    ]
    for line in _table(rows):
        print(line)
    source = f"file {args.config}" if args.config else "the defaults"
    print("\n* selected by " + source + ": " + ", ".join(f"{k} = {v!r}" for k, v in selected.items()))
    status = 0
    conflicts = [clashing for kind in registry.conflicts.values() for clashing in kind.values()]
    if conflicts:
        print("\n! conflicts (these names cannot be selected; every other name still works):")
        for clashing in conflicts:
            print(f"  {conflict_message(clashing)}")
        status = 1
    for kind, name in selected.items():
        if name in registry.conflicts[kind]:
            print(f"error: the selected {kind} {name!r} is registered by more than one plugin (see above)")
            status = 1
        elif kind == "attention" and name == "auto":
            if not registry.registrations[kind]:
                print(f"error: no attention backend is installed; {none_installed_hint(kind)}")
                status = 1
        elif name not in registry.registrations[kind]:
            installed = ", ".join(registry.names(kind)) or "none"
            print(f"error: {kind} {name!r} is not installed (installed: {installed}). {missing_hint(kind, name)}")
            status = 1
    # the model is picked from the checkpoint's architecture, so no name is selected: at least one must exist
    if not registry.registrations["model"] and not registry.conflicts["model"]:
        print(f"error: no model is installed; {none_installed_hint('model')}")
        status = 1
    if registry.broken:
        print("\nbroken plugins (not loaded):")
        for broken in registry.broken:
            where = " ".join(x for x in (broken.distribution, broken.version) if x)
            print(f"  {broken.plugin} ({where}): {broken.error}")
        status = 1
    return status

