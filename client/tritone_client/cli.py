"""`tritone-client generate|chat`: talk to a Tritone server, printing text as it arrives."""

from __future__ import annotations

import argparse
import sys

from tritone_client.client import TritoneClient


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="server address (default 127.0.0.1:8001 for grpc, :8000 for http)")
    p.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    p.add_argument("--model", default="ensemble", help="Triton model name (default ensemble)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--no-stream", action="store_true", help="wait for the whole answer")
    p.add_argument("--temperature", type=float, help="0 or unset: greedy")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--min-p", type=float)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--presence-penalty", type=float)
    p.add_argument("--frequency-penalty", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=None, help="stop word (repeatable)")
    p.add_argument("--bad-word", action="append", default=None, dest="bad_words",
                   help="word never to generate (repeatable)")
    p.add_argument("--json-schema", metavar="SCHEMA", help="constrain the answer to this JSON schema (text or @file)")
    p.add_argument("--json", action="store_true", help="constrain the answer to a JSON object")
    p.add_argument("--regex", help="constrain the answer to this regular expression")
    p.add_argument("--grammar", metavar="EBNF", help="constrain the answer to this EBNF grammar (text or @file)")


def _sampling(args) -> dict:
    names = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "seed")
    values = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    guides = [(kind, value) for kind, value in (("json_schema", args.json_schema), ("regex", args.regex),
                                                ("ebnf_grammar", args.grammar), ("json", "" if args.json else None))
              if value is not None]
    if len(guides) > 1:
        raise SystemExit("give one of --json-schema, --json, --regex, --grammar")
    if guides:
        kind, value = guides[0]
        if value.startswith("@"):
            value = open(value[1:], encoding="utf-8").read()
        values["guided_decoding_guide_type"] = kind
        if value:
            values["guided_decoding_guide"] = value
    return values


def _print_answer(client: TritoneClient, prompt: str | list[dict], args, **extra) -> str:
    text = []
    for chunk in client.generate(prompt, max_tokens=args.max_tokens, stream=not args.no_stream,
                                 stop_words=args.stop, bad_words=args.bad_words, **_sampling(args), **extra):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        text.append(chunk.text)
    sys.stdout.write("\n")
    return "".join(text)


def _client(args) -> TritoneClient:
    url = args.url or ("127.0.0.1:8001" if args.protocol == "grpc" else "127.0.0.1:8000")
    return TritoneClient(url, args.protocol, args.model)


def cmd_generate(args) -> int:
    with _client(args) as client:
        _print_answer(client, args.prompt, args,
                      **({"apply_chat_template": False} if args.raw else {}))
    return 0


def cmd_chat(args) -> int:
    messages = [{"role": "system", "content": args.system}] if args.system else []
    turns = list(args.message) if args.message else None
    with _client(args) as client:
        while True:
            if turns is not None:
                if not turns:
                    return 0
                user = turns.pop(0)
            else:
                try:
                    user = input("> ")
                except EOFError:
                    return 0
            messages.append({"role": "user", "content": user})
            # The server puts the messages in the model's chat template.
            answer = _print_answer(client, messages, args)
            messages.append({"role": "assistant", "content": answer})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tritone-client", description="Talk to a Tritone server.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt")
    _add_common(gen)
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("prompt")
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="a conversation in the model's chat template (reads lines from stdin)")
    _add_common(chat)
    chat.add_argument("--system", help="system message")
    chat.add_argument("--message", action="append", help="send these turns instead of reading stdin (repeatable)")
    chat.set_defaults(func=cmd_chat)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (RuntimeError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
