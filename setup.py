"""Build spekula's native CPU kernels (backends/native/csrc), the suffix drafter's tree and the n-gram
lookups (drafters/draftless/csrc) with the package; everything else is in pyproject.toml.

The kernels are loaded with ctypes (spekula.backends.native.lib); the drafters' libraries are extension
modules, because they are called every round right after a forward, where a ctypes call costs several
times as much as a module's.
-ffp-contract=off keeps the compiler from fusing a*b+c on its own, which the kernels' bitwise
row-invariance relies on; the AVX2 and AVX-512 files select their instruction sets themselves and are only called
after a CPU check, so the build stays portable.
"""

from setuptools import Extension, setup

SOURCES = ["sk_model.c", "sk_ctx.c", "sk_plan.c", "sk_seq_state.c", "sk_encode.c", "sk_test_entry.c", "sk_swa.c", "sk_gemma4.c", "sk_assistant.c", "sk_deltanet.c", "sk_dn_state.c", "sk_moe.c", "sk_oai.c", "sk_pool.c", "sk_pack.c", "sk_generic.c",
           "sk_avx2.c", "sk_avx2_gemm.c", "sk_avx2_dn.c", "sk_avx512.c", "sk_avx512_gemm.c", "sk_avx512_dn.c"]

setup(
    ext_modules=[
        Extension(
            "spekula.backends.native._sk",
            sources=[f"backends/native/csrc/{name}" for name in SOURCES],
            depends=["backends/native/csrc/sk.h", "backends/native/csrc/sk_moe.h", "backends/native/csrc/sk_pool.h", "backends/native/csrc/sk_avx512.h",
                     "backends/native/csrc/sk_avx2.h", "backends/native/csrc/sk_pack.h", "backends/native/csrc/sk_deltanet.h",
                     "backends/native/csrc/sk_dn_internal.h", "backends/native/csrc/sk_swa.h",
                     "backends/native/csrc/sk_rope.h", "backends/native/csrc/sk_assistant.h",
                     "backends/native/csrc/sk_ctx.h", "backends/native/csrc/sk_step.h", "backends/native/csrc/sk_gemma4.h",
                     "backends/native/csrc/sk_oai.h", "backends/native/csrc/sk_codebooks.h"],
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-pthread", "-std=gnu11"],
            extra_link_args=["-pthread"],
            libraries=["m"],
        ),
        # The suffix drafter's tree (drafters/draftless/suffix_tree.py), an extension module (see above).
        Extension(
            "spekula.drafters.draftless._suffix_tree",
            sources=["drafters/draftless/csrc/suffix_tree.c", "drafters/draftless/csrc/suffix_module.c"],
            depends=["drafters/draftless/csrc/int32_buffer.h"],
            extra_compile_args=["-O2", "-std=gnu11"],
        ),
        # The n-gram drafters' lookups (drafters/draftless/ngram_lookup.py), an extension module as well.
        Extension(
            "spekula.drafters.draftless._ngram_lookup",
            sources=["drafters/draftless/csrc/ngram_lookup.c", "drafters/draftless/csrc/ngram_module.c"],
            depends=["drafters/draftless/csrc/int32_buffer.h"],
            extra_compile_args=["-O2", "-std=gnu11"],
        ),
    ]
)
