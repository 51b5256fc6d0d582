"""The export back end: `step.export(dir)` writes a train step as a standalone C training library and program.

The export writes, into one directory:

    <name>.h            the C API: create / free a state, load / save a safetensors checkpoint,
                        set hyperparameters, the programs (one training step, the loss without an
                        update, predict), and the names, dtypes and shapes of the variables and of
                        each program's inputs and outputs, as tables and as query functions
    <name>.c            that API: it owns the variables (parameters, optimizer state, generator
                        state, step counters), sizes and plans the workspace from the batch size,
                        reads and writes safetensors in plain C. Code only: the values are in
    <name>.safetensors  the step's variables when exported (the library's own checkpoint layout;
                        <name>_load reads it, train_main loads it by default)
    <name>_step.c       the programs, the very source the C backend compiles (entry points renamed
    <name>_loss.c       with #defines), each of the kinds asked for by `programs=`
    <name>_predict.c
    <name>_runtime.c    the runtime the programs call (symgrad_runtime.h/.c, its GEMMs), its symbols
                        renamed <name>_sg_*: every global symbol of the library starts with <name>_,
                        so two exported models link into one program
    train_main.c        a training program (with a "step" program): a dataset file in, epochs of
                        shuffled batches, a warmup + cosine learning-rate schedule, the train and
                        validation loss printed, checkpoints written
    Makefile            `make` builds lib<name>.a (and train_main) with the flags the step used

`programs=("predict",)` exports an inference-only library: no optimizer state, no train_main; it
loads a training checkpoint, ignoring the entries it does not hold.

With backend="cuda" the programs are the CUDA backend's `.cu` files (nvcc; no runtime files), each
keeping its variables on the GPU; `<name>.c` moves a variable between the host and a program's
device copy only when another copy is newer (to save, to read, after a load).

Nothing needs Python, cffi or symgrad to build or run. What train_main does beside the library (its
dataset file, its shuffle, its learning-rate schedule) symgrad.tools.export_training does in Python, so
Python can write its data and reproduce its run. Templates: templates/export/*.j2.

The modules: `library` (the files written, each program's tables and expressions), `variables`
(the variables' values, the checkpoint header and the weights file, C literals), `formats` (what
the library shares with Python: dtype codes, the dataset's magic, the name rule; imports nothing).
The step gathers what this back end renders (symgrad/step/exporting.py): its programs, compiled or
as graphs, and its variables' values.
"""
