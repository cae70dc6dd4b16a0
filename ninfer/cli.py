"""The `ninfer` command: run, bench, serve, convert, synth, draft-head, inspect, verify, ppl, kl.

Results go to stdout, progress and errors to stderr; an error is one line and a non-zero exit code
(2 for bad input to convert / synth / draft-head and bad flags, 1 for an unsound artifact). Every flag's range and
every path is checked as the command line is parsed (`ninfer.cli_types`), before any work.
"""

from __future__ import annotations

import argparse
import json
import sys

import ninfer
from ninfer.cli_types import (
    Parser,
    UsageError,
    existing_dir,
    existing_file,
    finite_float,
    int_at_least,
    int_between,
    output_file,
    positive_int,
    positive_int_list,
    probability,
    token_ids,
)
from ninfer.config import MAX_DRAFT_TOKENS, SPEC_METHODS
from ninfer.errors import NinferError

EXIT_UNSOUND = 1
EXIT_BAD_INPUT = 2


def _artifact_id(text: str) -> bytes:
    from ninfer.artifact.framing import parse_artifact_id

    try:
        return parse_artifact_id(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_output_flags(parser: argparse.ArgumentParser) -> None:
    from ninfer.artifact.framing import DEFAULT_PART_CAP, PART_PAYLOAD_OFFSET

    parser.add_argument("--out", required=True, type=output_file,
                        help="the .ninfer file to write (missing folders are made)")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    parser.add_argument("--artifact-id", type=_artifact_id,
                        help="fixed 16-byte artifact id (32 hex digits or a UUID): makes the output reproducible")
    parser.add_argument("--part-size", type=int_at_least(PART_PAYLOAD_OFFSET + 1), default=DEFAULT_PART_CAP,
                        help="largest file in bytes; bigger artifacts continue in NAME.ninfer.part-NNNN files "
                             "(default %(default)s)")
    parser.add_argument("--device", default="cpu", help="where to quantize: cpu or cuda (default cpu)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def build_parser() -> argparse.ArgumentParser:
    from ninfer.convert.recipes import RECIPES

    parser = Parser(prog="ninfer", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"ninfer {ninfer.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    _add_run_parser(commands)
    _add_bench_parser(commands)
    _add_serve_parser(commands)
    _add_eval_parsers(commands)

    convert = commands.add_parser("convert", help="convert a Hugging Face Qwen3.5 checkpoint folder")
    convert.add_argument("--model", required=True, type=existing_dir,
                         help="the checkpoint folder (config.json, safetensors)")
    convert.add_argument("--recipe", required=True, choices=RECIPES, help="how to store the weights")
    convert.add_argument("--tokenizer", type=existing_dir,
                         help="take tokenizer.json / tokenizer_config.json / the chat template from this folder")
    convert.add_argument("--name", help="model name recorded in the artifact (default: the folder's name)")
    _add_output_flags(convert)

    synth = commands.add_parser("synth", help="a random-weight artifact at a preset's real shapes")
    from ninfer.convert.synth import PRESETS

    synth.add_argument("--preset", required=True, choices=list(PRESETS))
    synth.add_argument("--recipe", required=True, choices=RECIPES)
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--layers", type=positive_int, default=None,
                       help="keep only the first N decoder layers (a slice)")
    _add_output_flags(synth)
    _add_draft_head_parser(commands)

    inspect = commands.add_parser("inspect", help="components, configs, objects and totals of an artifact")
    inspect.add_argument("file", type=existing_file)
    inspect.add_argument("--json", action="store_true", help="machine-readable output")

    verify = commands.add_parser("verify", help="check structure, SHA256SUMS and that every object decodes")
    verify.add_argument("file", type=existing_file)
    verify.add_argument("--quiet", action="store_true", help="no progress bars")
    verify.add_argument("--device", default="cpu", help="where to decode: cpu or cuda (default cpu)")
    return parser


def _add_draft_head_parser(commands: argparse._SubParsersAction) -> None:
    from ninfer.convert.draft_head import DRAFT_FORMATS

    draft = commands.add_parser("draft-head", help="copy an artifact and add a restricted proposal head for MTP "
                                                   "drafts: the output head's rows of the most frequent tokens")
    draft.add_argument("model", type=existing_file, help="the .ninfer artifact to copy")
    draft.add_argument("--calibration", required=True, type=existing_file,
                       help="a UTF-8 text file (.txt, or .txt.xz) whose token frequencies choose the rows")
    draft.add_argument("--rows", required=True, type=positive_int,
                       help="rows of the draft head, at most the vocabulary (upstream's: 131072)")
    draft.add_argument("--format", choices=list(DRAFT_FORMATS), default="q4",
                       help="how the rows are stored: q4 (q4_g64_fp16, default, upstream's), q8, bf16, or head (the "
                            "output head's own format, rows copied exactly)")
    _add_output_flags(draft)


def _add_run_parser(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser("run", help="generate text (with no MODEL: the embedded demo model)")
    run.add_argument("model", nargs="?", type=existing_file,
                     help="a .ninfer artifact (default: the embedded demo model)")
    source = run.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the user's message (or, with --raw, the whole prompt text)")
    source.add_argument("--messages", type=existing_file,
                        help="a JSON file: a list of chat messages, or an object with 'messages' and optional 'tools'")
    source.add_argument("--prompt-ids", type=token_ids, help="the prompt as comma-separated token ids")
    run.add_argument("--raw", action="store_true", help="no chat template: the prompt text is tokenized as is")
    run.add_argument("--no-thinking", action="store_true", help="render the chat template with thinking off")
    run.add_argument("--max-new", type=positive_int, default=256, help="most tokens to generate (default 256)")
    run.add_argument("--max-context", type=positive_int, help="context length (default: the model's)")
    run.add_argument("--greedy", action="store_true", help="argmax decoding (temperature 0)")
    # the sampling flags' ranges are SamplingParams' own, checked by `ninfer run` before the model loads
    config = "default: the artifact's generation_config.json, else "
    run.add_argument("--temperature", type=finite_float,
                     help=f"divide the logits by T; 0 is greedy ({config}1; a config without do_sample is greedy)")
    run.add_argument("--top-k", type=int, help=f"keep the K most probable tokens; 0 keeps all ({config}0)")
    run.add_argument("--top-p", type=finite_float,
                     help=f"keep the smallest most probable set whose mass reaches P, in (0, 1] ({config}1)")
    run.add_argument("--min-p", type=finite_float,
                     help=f"keep tokens at least P times as probable as the best, in [0, 1) ({config}0)")
    run.add_argument("--presence-penalty", type=finite_float,
                     help="subtract X from the logit of every token already generated (OpenAI's; default 0)")
    run.add_argument("--frequency-penalty", type=finite_float,
                     help="subtract X times its count from the logit of every generated token (OpenAI's; default 0)")
    run.add_argument("--repetition-penalty", type=finite_float,
                     help=f"divide positive, multiply negative logits of prompt and generated tokens by X, > 0 "
                          f"(Hugging Face's; {config}1)")
    run.add_argument("--seed", type=int, help="seed of this request's sampler: same seed, same output (default: "
                                              "torch's global generator)")
    run.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    run.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    run.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                     help="compute dtype (default auto: fp32 on the CPU, bf16 on CUDA)")
    run.add_argument("--print-token-ids", action="store_true", help="print the generated ids after the text")
    _add_runner_flags(run)
    _add_verify_weights_flag(run)


def _add_serve_parser(commands: argparse._SubParsersAction) -> None:
    from ninfer.serve.main import add_arguments

    serve = commands.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server (with no MODEL: the "
                                              "embedded demo model)")
    add_arguments(serve)
    _add_runner_flags(serve)
    _add_verify_weights_flag(serve)


def _add_verify_weights_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verify-weights", action="store_true",
                        help="hash every weight at load against the SHA-256 the artifact records, before using it "
                             "(the embedded demo model always is)")


def _add_eval_parsers(commands: argparse._SubParsersAction) -> None:
    ppl = commands.add_parser("ppl", help="perplexity of a model on a text file (windowed, teacher-forced)")
    ppl.add_argument("model", type=existing_file, help="a .ninfer artifact")
    kl = commands.add_parser("kl", help="KL divergence of a model from a reference model on a text file")
    kl.add_argument("reference", type=existing_file, help="the reference .ninfer artifact (same tokenizer)")
    kl.add_argument("model", type=existing_file, help="the .ninfer artifact to compare with it")
    for parser in (ppl, kl):
        parser.add_argument("--text", required=True, type=existing_file, help="a UTF-8 text file (.txt, or .txt.xz)")
        parser.add_argument("--context", type=positive_int, default=512, help="tokens per window (default 512)")
        parser.add_argument("--stride", type=positive_int, default=256,
                            help="tokens between window starts; each window scores the positions the previous "
                                 "one did not (default 256)")
        parser.add_argument("--max-tokens", type=positive_int, help="score only the text's first N tokens")
        parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
        parser.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                            help="compute dtype (default auto: fp32 on the CPU, bf16 on CUDA)")
        parser.add_argument("--json", action="store_true", help="machine-readable output")


def _add_bench_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="prefill and decode speed as fractions of this machine's measured "
                                              "bandwidth and matmul limits")
    bench.add_argument("model", nargs="?", type=existing_file,
                       help="a .ninfer artifact (default: the embedded demo model)")
    bench.add_argument("-p", "--prompt-lengths", type=positive_int_list, default=[512, 8192],
                       help="prefill lengths (default 512,8192; capped by the context)")
    bench.add_argument("-n", "--new-tokens", type=positive_int, default=128, help="decode steps (default 128)")
    bench.add_argument("-b", "--batch-sizes", type=positive_int_list, default=[1, 2, 4, 8],
                       help="decode batch sizes (default 1,2,4,8)")
    bench.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    bench.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                       help="compute dtype (default auto: fp32 on the CPU, bf16 on CUDA)")
    _add_runner_flags(bench)
    bench.add_argument("--acceptance", type=probability,
                       help="with --spec: accept each draft with this probability (given the ones before it) instead "
                            "of the model's own acceptance, which random-weight artifacts make near zero; reported "
                            "as synthetic")
    bench.add_argument("--json", action="store_true", help="machine-readable output")


def _add_runner_flags(parser: argparse.ArgumentParser) -> None:
    """The runner and the fast path's KV and prefill options (shared by run, bench and serve)."""
    parser.add_argument("--runner", choices=["auto", "fast", "reference"], default="auto",
                        help="auto: the GPU fast path on CUDA when the model suits it (default), else the reference")
    parser.add_argument("--kv-dtype", choices=["bf16", "int8", "fp8"], default="bf16",
                        help="fast path KV cache precision (default bf16)")
    parser.add_argument("--state-dtype", choices=["fp32", "bf16"], default="fp32",
                        help="fast path GDN recurrent-state precision as stored (default fp32, the models' own; bf16 "
                             "halves its memory and traffic, computing in fp32 either way)")
    parser.add_argument("--prefill-chunk", type=positive_int, default=None,
                        help="prompt tokens per prefill pass of the model (default 4096; the memory plan reserves "
                             "room for one)")
    parser.add_argument("--spec", choices=SPEC_METHODS, default="none",
                        help="speculative decoding: mtp drafts with the artifact's MTP head and verifies the drafts "
                             "in one step (greedy output unchanged, sampling distribution unchanged); default none")
    parser.add_argument("--draft-tokens", type=int_between(1, MAX_DRAFT_TOKENS),
                        help=f"drafts per round with --spec (1..{MAX_DRAFT_TOKENS}; default: chosen per round from "
                             "the measured acceptance and round cost)")
    parser.add_argument("--lm-head-draft", action="store_true", default=None,
                        help="with --spec: drafts take the argmax over the artifact's restricted proposal head (made "
                             "by `ninfer draft-head`); verification still uses the whole head, so outputs never "
                             "change")


def _bench(args: argparse.Namespace) -> int:
    from ninfer.config import from_args
    from ninfer.engine import LLM
    from ninfer.eval.bench import format_report, report_json, run_bench

    if args.acceptance is not None and args.spec == "none":
        raise NinferError("--acceptance needs --spec mtp")
    slots = max(args.batch_sizes)
    config = from_args(args, max_concurrency=slots,
                       max_context=max(args.prompt_lengths) + args.new_tokens + 1)
    llm = LLM(args.model, config, progress=not args.json)
    lengths = [min(p, llm.max_context - args.new_tokens - 1) for p in args.prompt_lengths]
    if min(lengths) < 1:
        raise NinferError(f"--new-tokens {args.new_tokens} leaves no room for a prompt in {llm.max_context}")
    report = run_bench(llm, sorted(set(lengths)), args.new_tokens, args.batch_sizes, acceptance=args.acceptance)
    print(json.dumps(report_json(report), indent=1) if args.json else format_report(report))
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.command == "run":
        from ninfer.run import run_command

        return run_command(args)
    if args.command == "bench":
        return _bench(args)
    if args.command == "serve":
        from ninfer.serve.main import serve_command

        return serve_command(args)
    if args.command in ("ppl", "kl"):
        from ninfer.eval.perplexity import kl_command, ppl_command

        return ppl_command(args) if args.command == "ppl" else kl_command(args)
    if args.command in ("convert", "synth", "draft-head"):
        if args.out.exists() and not args.force:
            raise NinferError(f"{args.out} exists; pass --force to replace it")
        args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.command == "convert":
        from ninfer.convert.checkpoint import convert_checkpoint

        report = convert_checkpoint(args.model, args.recipe, args.out, tokenizer_dir=args.tokenizer, name=args.name,
                                    artifact_id=args.artifact_id, part_cap=args.part_size, device=args.device,
                                    quiet=args.quiet)
        _print_written(report)
        return 0
    if args.command == "synth":
        from ninfer.convert.synth import synth_artifact

        report = synth_artifact(args.preset, args.recipe, args.out, seed=args.seed, device=args.device,
                                artifact_id=args.artifact_id, part_cap=args.part_size, quiet=args.quiet,
                                layers=args.layers)
        _print_written(report)
        return 0
    if args.command == "draft-head":
        from ninfer.convert.draft_head import add_draft_head

        report = add_draft_head(args.model, args.calibration, args.rows, args.out, fmt=args.format,
                                artifact_id=args.artifact_id, part_cap=args.part_size, device=args.device,
                                quiet=args.quiet)
        names = ", ".join(f["name"] for f in report["files"])
        print(f"wrote {names}: {sum(f['bytes'] for f in report['files']):,d} bytes, draft head {report['rows']} rows "
              f"{report['format']}, covering {100 * report['coverage']:.2f} % of the calibration's "
              f"{report['calibration']['tokens']:,d} tokens, {report['seconds']:.1f} s")
        return 0
    from ninfer.artifact.inspect import format_summary, summarize, verify
    from ninfer.artifact.reader import Artifact

    with Artifact.open(args.file) as artifact:
        if args.command == "inspect":
            summary = summarize(artifact)
            print(json.dumps(summary, indent=1) if args.json else format_summary(summary))
            return 0
        report = verify(artifact, args.quiet, args.device)
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr)
    if not report.ok:
        for problem in report.problems:
            print(f"{args.file}: {problem}", file=sys.stderr)
        return EXIT_UNSOUND
    print(f"{args.file}: OK ({len(artifact.objects)} objects)")
    return 0


def _print_written(report: dict) -> None:
    total = sum(f["bytes"] for f in report["files"])
    names = ", ".join(f["name"] for f in report["files"])
    print(f"wrote {names}: {total:,d} bytes, recipe {report['recipe']}, {len(report['tensors'])} tensors, "
          f"{report['seconds']:.1f} s")


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv); returns the exit code (a refused command line: one line on
    stderr and 2)."""
    try:
        args = build_parser().parse_args(argv)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        return _run(args)
    except NinferError as exc:
        print(f"ninfer {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_UNSOUND if args.command in ("inspect", "verify") else EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("ninfer: interrupted", file=sys.stderr)
        return 130
