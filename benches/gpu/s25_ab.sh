#!/usr/bin/env bash
# Session 25: the multi-stream path's host work before (`genpool_base`, .gpu/base/libgenpool_torch.so:
# the session's start, f39948b) and after (best fit's placement with no list built, its own cut, the
# replay's stream list), taking turns: ab.sh with its default lists (the engine's CUDA replay of
# bert_serve_4streams, gpt2_prefetch, resnet_copy_overlap and serve8; PyTorch's entry points on serve8 and
# bert_serve_4streams). (Session 25's call 3 ran each replay round before the same round's PyTorch runs,
# with its own copy of the replay loop.)
exec "$(dirname "$0")/ab.sh" "$@"
