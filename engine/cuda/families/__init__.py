"""Model families on the CUDA backend: one module per family, and the registry that maps a GGUF's
general.architecture to its family (registry.py). Importing this package needs no CuPy.

    moe.py      llama, qwen2, qwen3 (dense FFNs), qwen2moe, qwen3moe, llama files with experts (mixtral)
    hybrid.py   qwen3next, qwen35moe: gated attention and Gated DeltaNet layers (gdn.py: the GDN kernels)
    gptoss.py   gpt-oss: sinks, window rings, biases, SWIGLU_OAI experts
    qwen4exp.py qwen4exp: hyper-connection streams, GDN with a sigmoid gate, QSA sparse attention, the PLE n-gram
                embedding (q4ops.py: its parts over cuda_src/hc.cu, qsa.cu and qwen4exp.cu)

A family is a class the backend builds with the model's config (moe.MoeFamily, which the others extend). The shared
engine asks it, and never tests the architecture:
    load_weights(model)                the non-expert weights: its layer dataclass (a matrices() method) per layer
    check_experts(layout)              refuse an expert layout its kernels do not take
    kv_cache(max_ctx, dtype, chunk, log), rope_table(n_pos)    its K/V layout and rotary table
    recurrent_state(stream)            the state carried between tokens besides K/V (snapshot/restore/zero/nbytes)
    prompt_buffers(T)                  the prompt pass's buffers beyond chunk_plan's own
    kernel_files, prompt_attention(mod, int8)                  the kernel variants it compiles
    decode_layers(step, recurrent)     its decode layer program: embed, per layer mixer / router / ffn, output
    prompt_layers(prefill, recurrent)  its prompt layer program: layer(li, ...) per chunk
    request_info(), reset_stats(), info(), close()   its own counters, facts and files (none in moe.py)
    window_program()                   (decode layer class, its verify-window step class: decode_window.py), or None
The layer programs' host hooks: the decode program's set_inputs(token, pos) before each launch, the prompt
program's begin_chunk(tokens, pos0) before each chunk (qwen4exp reads its n-gram rows there), then read_ahead(tokens)
when the next chunk is known (qwen4exp gathers its rows on a worker meanwhile), and host_facts() for the benches.
The decode program's phases are split where the routing is known: the prefetch may launch the router instead (and
runs before the ffn), the paged memory modes stage the routed experts there. docs/design.md, "How to add a family".
"""
