"""`hybrid chat`: interactive chat with the model's chat template, streaming each reply."""

from __future__ import annotations

import sys

from hybrid.errors import UsageError


def register(subparsers) -> None:
    from hybrid.loading.parse import add_model_arguments

    p = subparsers.add_parser("chat", help="interactive chat (chat template, streaming)",
                              description="Chat in the terminal. Commands: /reset clears the history, "
                              "/exit (or Ctrl-D) quits. Without --model the random-weight demo model is used.")
    p.add_argument("-n", "--max-new-tokens", type=int, default=256, help="reply length limit (default 256)")
    p.add_argument("--system", help="system prompt")
    add_model_arguments(p)
    p.set_defaults(func=run)


def run(args, input_fn=None) -> int:
    input_fn = input_fn or input  # looked up per call, so tests can replace builtins.input
    from hybrid.loading.parse import sampling_from_args
    from hybrid.loading.session import open_session

    sampling = sampling_from_args(args)
    s = open_session(args)
    if s.tokenizer.chat_template is None:
        raise UsageError(f"{s.model_dir} has no chat template (tokenizer_config.json); use `hybrid generate`")
    from hybrid.runtime.generation import Conversation

    base = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(base)
    conv = Conversation.open(s.engine)  # the KV slot this chat keeps: each turn prefills only what is new
    from hybrid.runtime.device_role import is_cuda

    where = "" if is_cuda(s.device) else " (CPU-only: no CUDA device, the model runs as torch on the CPU)"
    print(f"chat ready{where}: /reset clears the history, /exit quits", file=sys.stderr)
    while True:
        try:
            line = input_fn("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        cmd = line.strip()
        if cmd in ("/exit", "/quit"):
            return 0
        if cmd == "/reset":
            messages = list(base)
            continue
        if not cmd:
            continue
        messages.append({"role": "user", "content": line})
        ids = s.tokenizer.encode_chat(messages)
        if len(ids) >= args.max_context:
            print(f"the conversation has {len(ids)} tokens, more than --max-context {args.max_context}; "
                  "/reset to start over", file=sys.stderr)
            messages.pop()
            continue
        before = (s.engine.stats.decode_tokens, s.engine.stats.decode_s)

        def stream(_i, _t, delta):
            if delta:
                sys.stdout.write(delta)
                sys.stdout.flush()

        prefilled = s.engine.stats.prefill_tokens
        out = s.engine.generate([ids], max_new_tokens=args.max_new_tokens, sampling=sampling,
                                stop_strings=args.stop, stream=stream, conversation=conv)[0]
        prefilled = s.engine.stats.prefill_tokens - prefilled
        print()
        messages.append({"role": "assistant", "content": out.text})
        st = s.engine.stats
        n, dt = st.decode_tokens - before[0], st.decode_s - before[1]
        print(f"[{len(out.token_ids)} tokens; prefilled {prefilled} of {len(ids)} prompt tokens "
              f"({len(ids) - prefilled} reused from the last turn); prefill {st.prefill_tps:.1f} tok/s, decode "
              f"{(n / dt if dt else 0):.1f} tok/s]", file=sys.stderr)
