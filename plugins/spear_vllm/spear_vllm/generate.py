"""Greedy generation through vLLM's offline engine, timed: the vLLM half of spear's bench/vllm_compare.py.

    python -m spear_vllm.generate DIR --prompt-ids 1,504,3458 [--prompt-ids ...] [--max-tokens 64]
        [--quantization compressed-tensors] [--lora DIR/static_lora] [--dtype float16] [--eager]

prints one JSON object: each prompt's generated token ids, the timed seconds, tokens/s and the versions.
Each prompt runs alone (batch 1) after one untimed warm-up request; EOS is ignored so every prompt
generates --max-tokens tokens.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m spear_vllm.generate")
    p.add_argument("model")
    p.add_argument("--prompt-ids", action="append", required=True, help="comma-separated token ids (repeatable)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--quantization", default=None,
                   help="compressed-tensors: the W4 weights without the ECs (default: what the checkpoint asks for)")
    p.add_argument("--lora", default=None, help="a PEFT adapter directory (the export's static_lora)")
    p.add_argument("--max-lora-rank", type=int, default=32)
    p.add_argument("--dtype", default="float16", help="vLLM-CPU's W4A16 kernel takes float16 and bfloat16")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--memory-utilization", type=float, default=0.2,
                   help="vLLM's --gpu-memory-utilization (on CPU: the share of RAM it reserves)")
    p.add_argument("--eager", action="store_true", help="no torch.compile")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    args = p.parse_args()

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    lora = {} if args.lora is None else {"enable_lora": True, "max_lora_rank": args.max_lora_rank, "max_loras": 1}
    llm = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization, max_model_len=args.max_model_len,
              gpu_memory_utilization=args.memory_utilization, enforce_eager=args.eager,
              tensor_parallel_size=args.tensor_parallel_size, **lora)
    request = None
    if args.lora is not None:
        from vllm.lora.request import LoRARequest

        request = LoRARequest("spear-static", 1, args.lora)
    prompts = [[int(t) for t in ids.split(",")] for ids in args.prompt_ids]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], SamplingParams(temperature=0, max_tokens=8),
                 lora_request=request, use_tqdm=False)
    tokens, seconds = [], 0.0
    for ids in prompts:
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], greedy, lora_request=request, use_tqdm=False)
        seconds += time.perf_counter() - start
        tokens.append(list(out[0].outputs[0].token_ids))
    generated = sum(len(t) for t in tokens)
    quantization = llm.llm_engine.model_config.quantization
    print(json.dumps({"token_ids": tokens, "seconds": seconds, "tokens_per_s": generated / seconds,
                      "dtype": args.dtype, "eager": args.eager, "quantization": quantization,
                      "vllm": vllm.__version__}))


if __name__ == "__main__":
    main()
