"""Train a small Qwen3.5-architecture model with an MTP head on the project corpus; save an HF checkpoint.

    python tools/train_small.py --model dense --out out/dense [--steps N] [--device cuda] [--seed 0]
    python tools/train_small.py --model moe --out out/moe
    python tools/train_small.py --model dense --tiny --steps 3 --out /tmp/t   # CPU smoke test of the pipeline

The trunk is transformers' own Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM (8 layers: 3 Gated DeltaNet + 1
gated attention, twice). The MTP head follows the Qwen MTP form: for position t it reads the trunk's final
(normed) hidden state h_t and the embedding of the next token x_{t+1},
    u = fc([pre_fc_norm_embedding(embed(x_{t+1})) ; pre_fc_norm_hidden(h_t)])      (embedding first)
then one full-attention decoder layer over the sequence of u, `norm`, and the shared lm_head, trained to predict
x_{t+2} (loss weight MTP_WEIGHT). Plain PyTorch: AdamW, warmup + cosine, bf16 autocast on CUDA, fixed seed,
random windows of the train split. The checkpoint is written in the official layout (model.language_model.*,
lm_head, mtp.*, fused experts) with the tokenizer files, ready for `ninfer convert`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))

TOKENIZER_DIR = ROOT / "data" / "tokenizer"
MTP_WEIGHT = 0.3
CALIBRATION_STEPS = 40  # < warmup: the learning rate until then does not depend on the total step count
AUX_WEIGHT = 0.01  # MoE load balancing
IGNORE = -100  # cross-entropy target of an id no loss is taken on

# Model shapes: dense about 10 M and MoE about 14 M parameters with a 4,096-token vocabulary.
COMMON = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
              linear_value_head_dim=64, linear_conv_kernel_dim=4, max_position_embeddings=4096, rms_norm_eps=1e-6,
              tie_word_embeddings=False, mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25,
                               "mrope_section": [3, 3, 2], "mrope_interleaved": True})
SHAPES = {
    "dense": dict(intermediate_size=768),
    "moe": dict(num_experts=16, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=256),
}
TINY = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=16,
            shared_expert_intermediate_size=32, linear_key_head_dim=16, linear_value_head_dim=16, head_dim=32,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True})


def text_config(kind: str, tiny: bool, special_ids: dict[str, int]):
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    fields = {**COMMON, **SHAPES[kind], **(TINY if tiny else {})}
    if kind == "dense":
        fields = {k: v for k, v in fields.items() if k not in ("moe_intermediate_size",
                                                             "shared_expert_intermediate_size")}
    else:
        fields.pop("intermediate_size", None)
    count = fields["num_hidden_layers"]
    fields["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(count)]
    fields.update(eos_token_id=special_ids["<|im_end|>"], pad_token_id=special_ids["<|endoftext|>"])
    return (Qwen3_5MoeTextConfig if kind == "moe" else Qwen3_5TextConfig)(**fields)


class MTPHead(nn.Module):
    """The Qwen MTP block: fc over [norm(embed(x_{t+1})); norm(h_t)], one full-attention layer, a final norm."""

    def __init__(self, config, moe: bool):
        super().__init__()
        from transformers.models.qwen3_5 import modeling_qwen3_5 as dense_modeling
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as moe_modeling

        layer_config = config.__class__(**{**config.to_dict(), "num_hidden_layers": 1,
                                           "layer_types": ["full_attention"]})
        layer_config._attn_implementation = "sdpa"  # attention_mask=None is then causal
        # the trunk's own classes, so that the trunk's _init_weights recognises them (zero-centred norms = 0)
        norm = moe_modeling.Qwen3_5MoeRMSNorm if moe else dense_modeling.Qwen3_5RMSNorm
        layer = moe_modeling.Qwen3_5MoeDecoderLayer if moe else dense_modeling.Qwen3_5DecoderLayer
        h, eps = config.hidden_size, config.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = norm(h, eps)
        self.pre_fc_norm_hidden = norm(h, eps)
        self.layers = nn.ModuleList([layer(layer_config, 0)])
        self.norm = norm(h, eps)

    def forward(self, hidden: torch.Tensor, next_embeddings: torch.Tensor, rotary) -> torch.Tensor:
        u = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeddings), self.pre_fc_norm_hidden(hidden)], -1))
        positions = torch.arange(u.shape[1], device=u.device)[None].expand(u.shape[0], -1)
        cos_sin = rotary(u, positions[None].expand(3, -1, -1))  # [3, B, T]: the T/H/W rows of MRoPE (all equal)
        for layer in self.layers:
            out = layer(u, position_embeddings=cos_sin, attention_mask=None, position_ids=positions)
            u = out[0] if isinstance(out, tuple) else out
        return self.norm(u)


def build(kind: str, tiny: bool, special_ids: dict[str, int], device: torch.device):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM

    config = text_config(kind, tiny, special_ids)
    config._attn_implementation = "sdpa"
    model = (Qwen3_5MoeForCausalLM if kind == "moe" else Qwen3_5ForCausalLM)(config)
    mtp = MTPHead(model.config, kind == "moe")
    mtp.apply(model._init_weights)  # outside a PreTrainedModel nothing initialises e.g. the fused expert banks
    return model.to(device), mtp.to(device)


def losses(model, mtp, batch: torch.Tensor, moe: bool,
           mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """(main next-token loss, MTP next-next-token loss, MoE aux loss, stats) for windows [B, T + 2].

    `mask` [B, T + 2] (bool): the ids a loss is taken on (chat windows: the answers); None takes every id."""
    inputs = batch[:, :-1]  # [B, T+1]: the trunk sees T+1 tokens
    out = model.model(input_ids=inputs, output_router_logits=moe)
    hidden = out.last_hidden_state  # after the final norm
    targets = batch if mask is None else batch.masked_fill(~mask, IGNORE)
    logits = model.lm_head(hidden[:, :-1]).float()
    main = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[:, 1:-1].reshape(-1), ignore_index=IGNORE)
    next_embeddings = model.model.embed_tokens(batch[:, 1:-1])
    mtp_hidden = mtp(hidden[:, :-1], next_embeddings, model.model.rotary_emb)
    mtp_logits = model.lm_head(mtp_hidden).float()
    mtp_loss = F.cross_entropy(mtp_logits.reshape(-1, mtp_logits.shape[-1]), targets[:, 2:].reshape(-1),
                               ignore_index=IGNORE)
    aux = torch.zeros((), device=batch.device)
    if moe:
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func

        aux = load_balancing_loss_func(out.router_logits, model.config.num_experts,
                                       model.config.num_experts_per_tok, None)
    with torch.no_grad():
        stats = {"main_top1": top1(logits, targets[:, 1:-1]), "mtp_top1": top1(mtp_logits, targets[:, 2:])}
    return main, mtp_loss, aux, stats


def top1(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Fraction of the counted targets (not IGNORE) that are the logits' argmax."""
    counted = targets != IGNORE
    return float(((logits.argmax(-1) == targets) & counted).sum() / counted.sum().clamp(min=1))


def chat_windows(examples, count: int, length: int, rng) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` packed chat windows (ids [count, length], answer mask [count, length]); see chat_data.pack."""
    from chat_data import pack

    packed = [pack(examples, length, rng) for _ in range(count)]
    return (torch.tensor([ids for ids, _ in packed], dtype=torch.long),
            torch.tensor([mask for _, mask in packed], dtype=torch.bool))


def windows(ids: torch.Tensor, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, ids.numel() - length, (count,), generator=generator)
    return torch.stack([ids[s : s + length] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model, mtp, ids: torch.Tensor, seq: int, batch: int, device: torch.device, moe: bool,
             autocast) -> dict:
    """Held-out loss over consecutive non-overlapping windows (at most 32 batches)."""
    model.eval()
    mtp.eval()
    length = seq + 2
    count = min(32 * batch, (ids.numel() - 2) // seq)
    starts = list(range(0, count * seq, seq))
    totals = {"main": 0.0, "mtp": 0.0, "main_top1": 0.0, "mtp_top1": 0.0}
    n = 0
    for i in range(0, len(starts), batch):
        chunk = [s for s in starts[i : i + batch] if s + length <= ids.numel()]
        if not chunk:
            break
        data = torch.stack([ids[s : s + length] for s in chunk]).to(device)
        with autocast():
            main, mtp_loss, _, stats = losses(model, mtp, data, moe)
        totals["main"] += float(main) * len(chunk)
        totals["mtp"] += float(mtp_loss) * len(chunk)
        totals["main_top1"] += stats["main_top1"] * len(chunk)
        totals["mtp_top1"] += stats["mtp_top1"] * len(chunk)
        n += len(chunk)
    model.train()
    mtp.train()
    result = {k: v / n for k, v in totals.items()}
    result["main_ppl"] = math.exp(result["main"])
    return result


@torch.no_grad()
def evaluate_chat(model, mtp, ids: torch.Tensor, mask: torch.Tensor, batch: int, device: torch.device, moe: bool,
                  autocast) -> dict:
    """Held-out loss and top-1 on the answer ids of packed chat windows (ids, mask [N, T + 2])."""
    model.eval()
    mtp.eval()
    totals = {"main": 0.0, "main_top1": 0.0}
    for i in range(0, ids.shape[0], batch):
        with autocast():
            main, _, _, stats = losses(model, mtp, ids[i : i + batch].to(device), moe, mask[i : i + batch].to(device))
        count = ids[i : i + batch].shape[0]
        totals["main"] += float(main) * count
        totals["main_top1"] += stats["main_top1"] * count
    model.train()
    mtp.train()
    return {k: v / ids.shape[0] for k, v in totals.items()}


def official_state_dict(model, mtp) -> dict[str, torch.Tensor]:
    """The official Hub layout: model.language_model.*, lm_head.weight, mtp.* (experts stay fused), in bf16."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        key = "model.language_model." + name.removeprefix("model.") if name.startswith("model.") else name
        tensors[key] = tensor.detach().to("cpu", torch.bfloat16).contiguous()
    for name, tensor in mtp.state_dict().items():
        tensors["mtp." + name] = tensor.detach().to("cpu", torch.bfloat16).contiguous()
    return tensors


def save_checkpoint(out: Path, model, mtp, kind: str, log: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file(official_state_dict(model, mtp), str(out / "model.safetensors"), metadata={"format": "pt"})
    text = model.config.to_dict()
    for key in ("architectures", "_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        text.pop(key, None)
    text["full_attention_interval"] = 4
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration" if kind == "moe" else
                                "Qwen3_5ForConditionalGeneration"],
              "model_type": "qwen3_5_moe" if kind == "moe" else "qwen3_5", "text_config": text,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copyfile(TOKENIZER_DIR / name, out / name)
    (out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(SHAPES), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, help="optimizer steps (or let --time-budget choose them)")
    parser.add_argument("--time-budget", type=float, help="minutes of training: after CALIBRATION_STEPS steps the "
                        "step count is fixed from the measured speed and printed, so `--steps N` repeats the run")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes for a CPU smoke test")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--chat-steps", type=int, default=0, help="steps of a chat stage after pretraining: "
                        "requests built from the corpus's documented functions, answered with their source "
                        "(tools/chat_data.py); the loss is taken on the answers")
    parser.add_argument("--chat-fraction", type=float, default=0.5,
                        help="share of each chat-stage batch that is chat windows (the rest: plain windows)")
    args = parser.parse_args()
    if (args.steps is None) == (args.time_budget is None):
        parser.error("give exactly one of --steps and --time-budget")
    if args.warmup <= CALIBRATION_STEPS:
        parser.error(f"--warmup must exceed {CALIBRATION_STEPS}")

    from chat_data import chat_examples
    from corpus import documents, load_split
    from tokenizers import Tokenizer

    from ninfer.devices import synchronize
    from ninfer.frontend import ChatTemplate

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    tokenizer = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    template = ChatTemplate((TOKENIZER_DIR / "chat_template.jinja").read_text())

    def encode(text: str) -> list[int]:  # special tokens recognised, as LLM.prompt_ids encodes a rendered prompt
        return tokenizer.encode(text, add_special_tokens=False).ids

    special = {t: tokenizer.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")}
    started = time.time()
    train_ids = torch.tensor(tokenizer.encode(load_split("train")).ids, dtype=torch.long)
    test_ids = torch.tensor(tokenizer.encode(load_split("test")).ids, dtype=torch.long)
    print(f"corpus: {train_ids.numel():,d} train / {test_ids.numel():,d} test tokens "
          f"({time.time() - started:.1f} s)", flush=True)

    model, mtp = build(args.model, args.tiny, special, device)
    moe = args.model == "moe"
    params = sum(p.numel() for p in model.parameters()) + sum(p.numel() for p in mtp.parameters())
    print(f"{args.model}: {params / 1e6:.2f} M parameters (trunk + MTP)", flush=True)
    parameters = list(model.parameters()) + list(mtp.parameters())
    decay = [p for p in parameters if p.dim() >= 2]
    no_decay = [p for p in parameters if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def chat_lr_at(step: int) -> float:  # from the pretraining's final rate down to a tenth of it
        return args.lr * 0.1 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.chat_steps)))

    def train_step(step: int, lr: float, batch: torch.Tensor, mask: torch.Tensor | None, stage: str) -> None:
        nonlocal steps_done
        for group in optimizer.param_groups:
            group["lr"] = lr
        with autocast():
            main, mtp_loss, aux, stats = losses(model, mtp, batch, moe, mask)
            loss = main + MTP_WEIGHT * mtp_loss + AUX_WEIGHT * aux
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        steps_done += 1
        last = step + 1 == (args.steps if stage == "step" else args.chat_steps)
        if step % args.log_every == 0 or last:
            elapsed = time.time() - train_started
            main, mtp_loss, aux = main.detach(), mtp_loss.detach(), aux.detach()
            entry = {"stage": stage, "step": step, "loss": float(main), "mtp_loss": float(mtp_loss),
                     "aux": float(aux), "lr": lr, "seconds": round(elapsed, 1), **stats}
            history.append(entry)
            tokens = steps_done * args.batch * args.seq
            print(f"{stage} {step:5d}  loss {float(main):.3f}  mtp {float(mtp_loss):.3f}  top1 {stats['main_top1']:.3f}"
                  f"  mtp_top1 {stats['mtp_top1']:.3f}  {tokens / max(elapsed, 1e-9):,.0f} tok/s", flush=True)

    if args.chat_steps:
        chat_train, chat_test = (chat_examples(documents(load_split(split)), template, encode, seed=args.seed)
                                 for split in ("train", "test"))
        print(f"chat: {len(chat_train):,d} train / {len(chat_test):,d} test examples", flush=True)
        chat_rng = random.Random(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    history = []
    train_started = time.time()
    steps_done = 0
    step = 0
    calibration_start = 0.0
    while args.steps is None or step < args.steps:
        if args.steps is None and step == 10:
            synchronize(device)
            calibration_start = time.time()
        if args.steps is None and step == CALIBRATION_STEPS:
            synchronize(device)
            per_step = (time.time() - calibration_start) / (CALIBRATION_STEPS - 10)
            args.steps = max(CALIBRATION_STEPS + 1, int(60 * args.time_budget / per_step))
            print(f"calibrated: {per_step * 1000:.0f} ms per step -> --steps {args.steps}", flush=True)
        batch = windows(train_ids, args.batch, args.seq + 2, generator).to(device, non_blocking=True)
        train_step(step, lr_at(step), batch, None, "step")
        step += 1
    if args.chat_steps:
        chat_count = max(1, round(args.batch * args.chat_fraction))
        for chat_step in range(args.chat_steps):
            ids, mask = chat_windows(chat_train, chat_count, args.seq + 2, chat_rng)
            raw = windows(train_ids, args.batch - chat_count, args.seq + 2, generator)
            batch = torch.cat([ids, raw]).to(device, non_blocking=True)
            mask = torch.cat([mask, torch.ones_like(raw, dtype=torch.bool)]).to(device, non_blocking=True)
            train_step(chat_step, chat_lr_at(chat_step), batch, mask, "chat")
    train_seconds = time.time() - train_started
    held_out = evaluate(model, mtp, test_ids, args.seq, args.batch, device, moe, autocast)
    print(f"held-out: loss {held_out['main']:.3f} (ppl {held_out['main_ppl']:.2f}), top1 {held_out['main_top1']:.3f}, "
          f"mtp top1 {held_out['mtp_top1']:.3f}", flush=True)
    held_out_chat = None
    if args.chat_steps:
        ids, mask = chat_windows(chat_test, 64, args.seq + 2, random.Random(args.seed))
        held_out_chat = evaluate_chat(model, mtp, ids, mask, args.batch, device, moe, autocast)
        print(f"held-out chat answers: loss {held_out_chat['main']:.3f}, top1 {held_out_chat['main_top1']:.3f}",
              flush=True)
    log = {"model": args.model, "args": {k: str(v) for k, v in vars(args).items()}, "parameters": params,
           "steps_done": steps_done, "train_seconds": round(train_seconds, 1),
           "tokens_seen": steps_done * args.batch * args.seq, "held_out": held_out, "held_out_chat": held_out_chat,
           "history": history,
           "torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    save_checkpoint(args.out, model, mtp, args.model, log)
    print(f"saved {args.out} ({steps_done} steps, {train_seconds:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
