"""Write a SmolLM2 GGUF holding only its first N transformer blocks (for the GPU device).

The embedded SmolLM2-135M-Instruct GGUF is 98 MB, more than may travel to the
GPU machine in one call (64 MiB with the FlashInfer bundle).  Its first N
blocks plus the embedding, final norm and tokenizer keep every real-weight
property the GPU tests need (head dim 64, 9 query / 3 KV heads, tied
embeddings, rope theta 1e5, real activations) at about 30 MB + 2.2 MB per
block.  Tensors are copied raw (still Q8_0 / Q4_1 / F32), metadata as-is
except ``llama.block_count``.

    python bench/smollm2_subset.py --layers 6 --out .devmodel/smollm2-6l.gguf
"""

from __future__ import annotations

import argparse
import logging
import os

logger = logging.getLogger("smollm2_subset")

_INTERNAL = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture"}


def write_subset(src: str, dst: str, layers: int) -> int:
    """Copy ``src`` to ``dst`` keeping blocks ``0..layers-1``; returns the bytes written."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    total = int(reader.fields[f"{arch}.block_count"].contents())
    if not 1 <= layers <= total:
        raise ValueError(f"--layers must be in 1..{total}")
    writer = gguf.GGUFWriter(dst, arch)
    for key, fld in reader.fields.items():
        if key in _INTERNAL:
            continue
        vtype = gguf.GGUFValueType(fld.types[0])
        if key == f"{arch}.block_count":
            writer.add_key_value(key, layers, vtype)
        elif vtype == gguf.GGUFValueType.ARRAY:
            sub = gguf.GGUFValueType(fld.types[1])
            writer.add_key_value(key, fld.contents(), vtype, sub_type=sub)
        else:
            writer.add_key_value(key, fld.contents(), vtype)
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers:
            continue
        # quantized tensors come as uint8 rows of blocks; the writer derives the shape from them
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return os.path.getsize(dst)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--src", default=None, help="source GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    src = args.src
    if src is None:
        from kvship.engine.embedded import embedded_model_path

        src = embedded_model_path()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    size = write_subset(src, args.out, args.layers)
    logger.info("wrote %s: %d blocks, %.1f MB", args.out, args.layers, size / 1e6)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
