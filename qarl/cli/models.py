"""`qarl models [--prepare NAME|all] [--force]`: list the embedded model zoo, preparing
models first when asked."""

from __future__ import annotations

import argparse

from qarl.model.zoo import ZOO, is_prepared, model_folder, prepare
from qarl.paths import qarl_home


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prepare", metavar="NAME", choices=sorted(ZOO) + ["all"],
        help=f"prepare a zoo model ({', '.join(sorted(ZOO))}) or all of them, then list the zoo",
    )
    parser.add_argument("--force", action="store_true", help="prepare again even if already prepared")


def run(args: argparse.Namespace) -> int:
    if args.force and not args.prepare:
        from qarl.errors import UserError

        raise UserError("--force prepares again what --prepare names; add --prepare NAME (or "
                        "all), or drop --force")
    if args.prepare:
        for name in sorted(ZOO) if args.prepare == "all" else [args.prepare]:
            print(f"preparing {name} ...", flush=True)
            print(f"  -> {prepare(name, force=args.force)}")
    print(f"zoo under QARL_HOME={qarl_home()}")
    w_name, w_family = max(map(len, ZOO)), max(len(e.family) for e in ZOO.values())
    print(f"{'name':<{w_name}} {'family':<{w_family}} {'params':>6}  {'prepared':<8}  path / description")
    for name, entry in sorted(ZOO.items()):
        state = "yes" if is_prepared(name) else "no"
        where = model_folder(name) if is_prepared(name) else entry.description
        print(f"{name:<{w_name}} {entry.family:<{w_family}} {entry.params:>6}  {state:<8}  {where}")
    return 0
