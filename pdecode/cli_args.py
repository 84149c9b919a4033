"""The argument parser every ``pdecode`` command and ``python -m train.*`` / ``infer.*`` entry point uses: a flag it
does not know is answered with the closest flag it does ("--temprature: did you mean --temperature?"), not argparse's
bare "unrecognized arguments"."""

from __future__ import annotations

import argparse
import difflib


def unknown_message(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """One line for the arguments ``parser`` did not recognise: each unknown flag with its closest known flag."""
    flags = sorted(s for s in parser._option_string_actions if s.startswith("--"))  # noqa: SLF001 (argparse's own)
    parts, after_flag = [], False
    for tok in unknown:
        if not tok.startswith("-") or tok == "-":
            if not after_flag:  # (a value right after an unknown flag is that flag's)
                parts.append(f"unexpected argument {tok!r}")
            after_flag = False
            continue
        after_flag = "=" not in tok
        name = tok.split("=", 1)[0]
        close = difflib.get_close_matches(name if name.startswith("--") else "-" + name, flags, n=1, cutoff=0.6)
        parts.append(f"unknown flag {name}" + (f": did you mean {close[0]}?" if close else ""))
    return "; ".join(parts) + f" ({parser.prog} --help lists the flags)"


class ArgumentParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose unknown flags get the closest known one suggested."""

    def parse_args(self, args=None, namespace=None):
        ns, rest = self.parse_known_args(args, namespace)
        if rest:
            self.error(unknown_message(self, rest))
        return ns
