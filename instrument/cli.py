"""``instrument run CONFIG.gin [--bind 'Name.param = value' ...]``: run any gin-bound experiment."""

import argparse
import sys
from typing import List, Optional


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="instrument", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the experiment bound in a .gin file")
    run.add_argument("config", nargs="+", help="one or more .gin files (later ones override earlier ones)")
    run.add_argument("--bind", action="append", default=[], metavar="BINDING",
                     help="an extra gin binding, e.g. 'train_nca.steps = 50' (repeatable)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    from instrument import config

    try:
        config.parse(args.config, args.bind)
    except (ValueError, FileNotFoundError) as exc:  # gin's messages already name the file and line
        print(f"instrument: configuration error: {exc}", file=sys.stderr)
        return 2
    outcome = config.run()
    result = outcome["result"]
    if isinstance(result, dict):
        summary = ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in result.items()
            if isinstance(v, (int, float, str))
        )
        print(f"done: {summary}")
    print(f"logs: {outcome['run_dir']}")
    print(f"view them with: tensorboard --logdir {outcome['log_root']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
