"""The `domino-spec` command."""

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="domino-spec", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="stream a chat answer with the shipped draft")
    demo.add_argument("--tiny", action="store_true", help="random tiny models, no assets needed")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from ..generation.demo import run_tiny_demo

        run_tiny_demo()


if __name__ == "__main__":
    main()
