"""Fine-tune all-MiniLM-L6-v2 on BBC News (5 topics), in one process or split.

    python examples/finetune_local.py      # ordinary PyTorch
    python examples/finetune_split.py      # the same, split: the edge keeps the data, the embeddings,
                                           # encoder layers 0-1, the head and the labels; a cloud trains
                                           # layers 2-5 (started on 127.0.0.1, or give --connect ADDRESS)

The two scripts differ in five lines: diff them to see what splitft asks of a training script.
"""

import time

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader
from tqdm import tqdm

import common
import splitft
from splitft.app.tasks.bbc import minilm_classifier

args = common.parse_args()
torch.manual_seed(args.seed)
train, test = common.datasets(args)

model = minilm_classifier()
model = splitft.split(model, "bert.encoder.layer.2:6", factory=splitft.Factory(common.FACTORY, weights="factory"), connect=common.cloud(args), codecs=args.fwd)
opt = model.attach(torch.optim.AdamW(model.parameters(), lr=args.lr))

start = time.perf_counter()
for epoch in range(args.epochs):
    model.train()
    for input_ids, attention_mask, labels in tqdm(DataLoader(train, args.batch_size, shuffle=True),
                                                  desc=f"epoch {epoch + 1}/{args.epochs}"):
        loss = F.cross_entropy(model(input_ids, attention_mask), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
seconds = time.perf_counter() - start
print(splitft.metrics.format_report(model.metrics, seconds))

accuracy = common.evaluate(model, test, args.batch_size)
print(f"test accuracy {accuracy:.4f} after {args.epochs} epoch(s), {seconds:.1f} s of training")
model.close()
