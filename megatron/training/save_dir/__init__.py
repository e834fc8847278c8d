"""Where a job or a conversion writes, checked before any work: the save directory's checks in one package.

- ``writable``: an output location can be written (a file is created and removed where it will go; a directory
  that does not exist yet is tried at its nearest existing parent). Also --tensorboard-dir and MegaDPP's
  --dpp-log-schedule.
- ``checks``: ``pretrain_gpt.py``'s --save at start-up: writable, not behind its latest checkpoint (unless
  --override-save), enough free space for one checkpoint, and claimed by the job (``claim_save_dir``).
- ``lock``: the claim, an exclusive ``flock`` held by rank 0 for the job's life.
- ``checkpoints``: which iterations a directory holds and what is wrong with a damaged one, in one line.
- ``conversion_output``, ``conversion_staging``: ``tools/checkpoint/convert.py``'s --save-dir: new and empty,
  written in a hidden directory beside it and renamed into place when complete, claimed by one conversion, and
  what an interrupted one left removed.
"""
