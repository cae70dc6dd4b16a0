"""A chat-format training stage for a small model's artifact, on the CPU: the top decoder layers, the final norm, the
head and the MTP head learn the chat format (tools/chat_data.py: requests built from documented functions,
answered with their source, with and without an empty reasoning block) while half of each batch stays plain
corpus text; the rest of the model is frozen. The result is written as an artifact with the same objects, formats,
resources and id; frozen objects keep their bytes.

    python tools/chat_tune.py --model ninfer/assets/demo.ninfer --out /tmp/demo-chat.ninfer [--steps 160]

This is the path for machines without a GPU; `tools/train_small.py --chat-steps` trains the whole model the same
way when a checkpoint and a GPU are at hand.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))

from chat_data import chat_examples, pack  # noqa: E402
from corpus import documents, load_split  # noqa: E402

from ninfer.artifact.checksums import hash_files, update_sums  # noqa: E402
from ninfer.artifact.reader import Artifact  # noqa: E402
from ninfer.artifact.writer import ArtifactWriter, ResourceSpec, TensorSpec, plan_objects  # noqa: E402
from ninfer.frontend import ChatTemplate, Tokenizer  # noqa: E402
from ninfer.kernels.norm import rms_norm  # noqa: E402
from ninfer.model.config import FULL_ATTENTION  # noqa: E402
from ninfer.model.qwen3_5 import Qwen35Model, _LayerWeights  # noqa: E402
from ninfer.quant import codec_for  # noqa: E402

MTP_WEIGHT = 0.3
OPENING = 4  # ids at the start of an answer weighted by --opening-weight: `\n</think>\n\n` or the code fence
GENERATION_CONFIG = "frontend/generation_config.json"


def answer_weights(mask: torch.Tensor, opening: float) -> torch.Tensor:
    """Loss weights of a window's ids: 0 off the answers, 1 on them, `opening` on each answer's first OPENING ids
    (the close of the empty reasoning block and the code fence: they decide whether a chat answer has content,
    and are a handful of ids among hundreds)."""
    weights = mask.float()
    starts = (mask[1:] & ~mask[:-1]).nonzero().view(-1) + 1
    for start in starts.tolist():
        weights[start : start + OPENING] *= opening
    return weights


def forward(model: Qwen35Model, ids: torch.Tensor, frozen: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [T, V], MTP logits [T-2, V] for x_{t+2}) of one window; layers below `frozen` run without grad."""
    c = model.config
    state = model.new_state(ids.numel())
    positions = torch.arange(ids.numel())
    from ninfer.kernels.rope import rope_cos_sin

    cos, sin = rope_cos_sin(positions, c.rotary_dim, c.rope_theta, list(c.mrope_section) if c.mrope_section
                            else None, dtype=model.dtype)
    x = model.embed(ids)
    for i, kind in enumerate(c.layer_types):
        with torch.set_grad_enabled(i >= frozen):
            w = _LayerWeights(model.weights, f"layers/{i}/")
            h = rms_norm(x, w["input_norm"], c.rms_eps)
            h = model.attention(h, w, state, i, 0, cos, sin) if kind == FULL_ATTENTION else \
                model.gated_deltanet(h, w, state, i)
            x = x + h
            x = x + model.mlp(rms_norm(x, w["post_attention_norm"], c.rms_eps), w)
    hidden = rms_norm(x, model.weights["final_norm"], c.rms_eps)
    logits = hidden @ model.head.T
    mtp = model.mtp_logits(hidden[:-2], ids[1:-1], model.new_mtp_state(ids.numel()))
    return logits, mtp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--batch", type=int, default=8, help="windows per step, half of them chat")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--top-layers", type=int, default=1, help="decoder layers trained, from the top")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--opening-weight", type=float, default=8.0,
                        help="loss weight of the first ids of each answer (see answer_weights)")
    parser.add_argument("--temperature", type=float, default=0.6,
                        help="the sampling temperature written into the output's generation_config.json (upstream "
                             "NInfer's default and published profile: 0.6 with top-p 0.95, top-k 20)")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    started = time.time()
    with Artifact.open(args.model) as artifact:
        model = Qwen35Model.from_artifact(artifact)
        tokenizer = Tokenizer.from_artifact(artifact)
        template = ChatTemplate.from_artifact(artifact)
    frozen = model.config.layers - args.top_layers
    trained = [name for name in model.weights if name.startswith(("mtp/", "final_norm", "output_head"))
               or any(name.startswith(f"layers/{i}/") for i in range(frozen, model.config.layers))]
    for name in trained:
        model.weights[name].requires_grad_(True)
    model.head = model.weights["output_head"]
    optimizer = torch.optim.AdamW([model.weights[n] for n in trained], lr=args.lr, weight_decay=0.0)
    splits = {s: documents(load_split(s)) for s in ("train", "test")}
    chats = {s: chat_examples(d, template, tokenizer.encode, seed=args.seed) for s, d in splits.items()}
    train_ids = tokenizer.encode(load_split("train"), special=False)
    print(f"{len(chats['train'])} chat examples, {len(trained)} trained tensors, layers {frozen}.. trained",
          flush=True)
    length = args.seq + 2

    def loss_of(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, mtp = forward(model, ids, frozen)
        weights = answer_weights(mask, args.opening_weight)
        main = (F.cross_entropy(logits[:-1], ids[1:], reduction="none") * weights[1:]).sum()
        draft = (F.cross_entropy(mtp, ids[2:], reduction="none") * weights[2:]).sum()
        # means over the counted targets (a window may hold none of an answer's ids: a long earlier turn)
        return main / weights[1:].sum().clamp(min=1), draft / weights[2:].sum().clamp(min=1)

    history = []
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        optimizer.zero_grad(set_to_none=True)
        losses = []
        for index in range(args.batch):
            if index % 2 == 0:
                ids, mask = pack(chats["train"], length, rng)
            else:
                start = rng.randrange(len(train_ids) - length)
                ids, mask = train_ids[start : start + length], [True] * length
            main, draft = loss_of(torch.tensor(ids), torch.tensor(mask))
            ((main + MTP_WEIGHT * draft) / args.batch).backward()
            losses.append((index % 2 == 0, float(main.detach())))
        torch.nn.utils.clip_grad_norm_([model.weights[n] for n in trained], 1.0)
        optimizer.step()
        chat = sum(v for c, v in losses if c) / sum(c for c, _ in losses)
        plain = sum(v for c, v in losses if not c) / sum(not c for c, _ in losses)
        history.append({"step": step, "chat_loss": chat, "plain_loss": plain})
        if step % 10 == 0 or step + 1 == args.steps:
            print(f"step {step:4d}  chat {chat:.3f}  plain {plain:.3f}  {time.time() - started:.0f} s", flush=True)
    with torch.no_grad():
        held = [loss_of(*map(torch.tensor, pack(chats["test"], length, random.Random(i))))[0] for i in range(16)]
    print(f"held-out chat answers: loss {sum(map(float, held)) / len(held):.3f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write(args.model, args.out, model, set(trained) if args.steps else set(),
          {"steps": args.steps, "top_layers": args.top_layers, "history": history[-5:]}, args.temperature)
    print(f"wrote {args.out} ({time.time() - started:.0f} s)", flush=True)


def write(source: Path, out: Path, model: Qwen35Model, trained: set[str], log: dict, temperature: float) -> None:
    """The source artifact with the trained tensors re-encoded in their formats and the generation config's
    temperature set; every other object's bytes as they were."""
    with Artifact.open(source) as artifact:
        directory = artifact.directory
        config = json.loads(bytes(artifact.raw(GENERATION_CONFIG).numpy()))
        generation = (json.dumps({**config, "temperature": temperature}, indent=2) + "\n").encode()
        specs = []
        for obj in artifact.objects:
            size = len(generation) if obj.id == GENERATION_CONFIG else obj.bytes
            specs.append(ResourceSpec(obj.id, size) if obj.kind != "tensor"
                         else TensorSpec(obj.id, tuple(obj.shape), obj.format))
        provenance = dict(directory.provenance)
        if log["steps"]:  # --steps 0 only rewrites the generation config: the stage that trained stays recorded
            provenance["chat_stage"] = json.loads(json.dumps(log))
        with ArtifactWriter(out, plan_objects(specs), directory.components, directory.metadata, provenance,
                            artifact.artifact_id) as writer:
            for obj in artifact.objects:
                name = obj.id.removeprefix("text/")
                if obj.kind == "tensor" and name in trained:
                    writer.write(obj.id, codec_for(obj.format).encode(model.weights[name].detach()))
                elif obj.id == GENERATION_CONFIG:
                    writer.write(obj.id, generation)
                else:
                    writer.write(obj.id, bytes(artifact.raw(obj.id).numpy()))
    update_sums(out.parent, hash_files(writer.final_paths, quiet=True))


if __name__ == "__main__":
    main()
