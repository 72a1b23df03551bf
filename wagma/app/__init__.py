"""The training application, built on the library: ``train.py`` with Hydra configs, datasets, models, load
imbalance, checkpoints, metrics, the averaging-policy registry and the launcher.

The library (everything in :mod:`wagma` outside this subpackage) never imports it; this subpackage may use
Hydra, tqdm and TensorBoard (``pip install wagma[app]``). Importing ``wagma.app`` loads nothing: import the
module you need (:mod:`wagma.app.train`, :mod:`wagma.app.policies`, ...).
"""
