"""Part 3: TRL's GRPOTrainer (CPU, use_vllm=False) on the identical tiny GRPO problem.

Run by run.py in its own process (TRL imports its world; keeping it out of the bench's
process keeps the other parts' numbers clean):

    python tools/bench/trl_peer.py --model M --data D --steps N --out trl.jsonl

Identical to our tiny_cpu preset: model, tokenizer, prompts (plain strings: our chat template
renders a user message as its content, so the token ids are the same), 32 prompts x 16
samples per step, 3 new tokens, temperature 1, an lr (--lr) on a cosine to 0.1x over
the run, grad clip 1, no
KL, PPO clip 0.2, group-normalised advantages, one optimizer step per batch, and the same
reward (exact match, only when the model stopped itself). TRL is one process on both cores
(2 torch threads); ours runs rollout and trainer on one core each.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, required=True,
                    help="its learning rate (run.py passes TRL's best on this task, TRL_LR)")
    ap.add_argument("--seed", type=int, default=0,
                    help="TRL's seed: data order and sampling (run.py: the repeat's index)")
    args = ap.parse_args()

    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    data = load_dataset("json", data_files=args.data, split="train")
    rewards: list[float] = []

    def exact_match(completions, completion_ids, label, **_):
        out = [1.0 if tok.eos_token_id in ids and text.strip() == str(lab).strip() else 0.0
               for text, ids, lab in zip(completions, completion_ids, label)]
        rewards.append(sum(out) / len(out))
        return out

    rows: list[dict] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            self.t0 = self.last = time.monotonic()

        def on_step_end(self, args_, state, control, **k):
            now = time.monotonic()
            rows.append({"step": state.global_step - 1, "step_time_s": now - self.last,
                         "reward": rewards[-1] if rewards else 0.0, "samples": 512})
            self.last = now

    cfg = GRPOConfig(
        output_dir=str(Path(args.out).parent / "trl_out"), use_cpu=True, bf16=False,
        per_device_train_batch_size=512, num_generations=16, max_completion_length=3,
        temperature=1.0, learning_rate=args.lr, lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1}, warmup_steps=0, max_grad_norm=1.0,
        beta=0.0, epsilon=0.2, loss_type="grpo", scale_rewards="group", num_iterations=1,
        max_steps=args.steps, logging_steps=1, report_to="none", save_strategy="no", seed=args.seed,
        dataloader_num_workers=0, disable_tqdm=True,
        gradient_checkpointing=False,  # ours does not checkpoint activations either
    )
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=cfg, train_dataset=data,
                          processing_class=tok, callbacks=[Clock()])
    t0 = time.monotonic()
    trainer.train()
    wall = time.monotonic() - t0
    Path(args.out).write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    print(json.dumps({"steps": len(rows), "train_wall_s": wall, "pid": os.getpid()}))


if __name__ == "__main__":
    main()
