"""How much does what crosses the cut give away? Accuracy and bytes beside attacks, per codec and defence.

Trains the digits CNN split U-shape between this process and a real ``splitft cloud`` process on
loopback, for every setting (a codec, plus leak loss, DP noise on activations or on label
gradients, randomized response), several seeds each. Then it attacks what the cloud received:
distance correlation, a model-inversion decoder trained on held-back images (MSE, SSIM), and
the label-leak direction attack on the returned gradients; the epsilon spent comes from the
accountant. Writes privacy.csv, privacy.md and privacy.png into --out (see docs/privacy.md).

    python scripts/privacy_eval.py --out docs/privacy --seeds 3 --epochs 10
    python scripts/privacy_eval.py --settings identity,bsl,dp-eps3 --seeds 1 --epochs 2 --inproc
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # edge and cloud share this machine's cores

import sys  # noqa: E402

from splitft.privacy.report import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
