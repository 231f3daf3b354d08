"""Locret retaining heads: from PyTorch checkpoints to the heads GGUF format (convert/HEADS-FORMAT.md).

One job per module:

- ``errors``:        the one exception type whose message the command line prints as its refusal
- ``architectures``: which llama.cpp architectures are supported, whether their Q/K are permuted,
                     and the FFN activation the heads use
- ``base_model``:    the hyperparameters of the base model, read from its GGUF
- ``checkpoint``:    finding and lazily reading the head tensors in .bin/.safetensors/directories
- ``permutation``:   the column order that maps Hugging Face Q/K order to llama.cpp's
- ``heads``:         checking a checkpoint against the base model and preparing each layer's weights
- ``gguf_output``:   the heads' GGUF keys and tensors, written standalone or merged into a model
- ``random_heads``:  randomly initialised heads in the published Locret checkpoint format

Training (convert/train_heads.py):

- ``backbone``:      the frozen transformers model, its taps for the heads' input and the labels
- ``labels``:        the labels: max pre-softmax score from answer tokens, max over the GQA group
- ``heads_model``:   the heads as a torch module, the loss and the top-10 % accuracy
- ``training_data``: local SFT files (sharegpt, messages, prompt/answer) and their tokenization
- ``synthetic``:     the built-in offline generator (Python's own documentation as text)
- ``trainer``:       the loop, checkpoints, logs, the loss plot and the export through the converter
"""
