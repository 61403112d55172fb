# The device call of 2026-12-04 (third GPU session), kept as it ran; .gpu/ (ignored) held the MOSES files, the X libraries RDKit draws with and .gpu/sample_part.py.
#!/usr/bin/env bash
# one device call (~575 s): gpu_tune bigbird D=32; pytest -m gpu (background) beside moses256 training (290 s);
# then 64 drawings sampled in 4 processes; checkpoint + PNGs come back for OSRA read-back here
set -u
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site
mkdir -p /tmp/xlib && for f in .gpu/*.deb; do dpkg -x $f /tmp/xlib; done
export LD_LIBRARY_PATH=/tmp/xlib/usr/lib/x86_64-linux-gnu
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
python3 -c "import torch, triton, imggen.kernels, rdkit; from rdkit import Chem; from rdkit.Chem import Draw; Draw.MolToImage(Chem.MolFromSmiles('c1ccccc1')); print('torch', torch.__version__, 'triton', triton.__version__, 'rdkit draw ok')"
el "gpu_tune --head-dim 32 --rows 3 (bigbird)"
timeout -k 5 55 python3 bench/gpu_tune.py --head-dim 32 --rows 3 --budget 45 > $OUT/gpu_tune.log 2>&1
echo "gpu_tune rc=$?"; tail -n 30 $OUT/gpu_tune.log
el "pytest -m gpu (background) + moses256 train"
timeout -k 5 330 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider -o addopts="" -rfE --durations=12 > $OUT/pytest_gpu.log 2>&1 &
PT=$!
timeout -s INT -k 30 290 python3 train.py --preset moses256 --data moses:.gpu/moses --out /tmp/m256 --steps 3000 --train.warmup 100 --no-progress > /tmp/m256_train.log 2>&1
echo "train rc=$?"; tail -n 8 /tmp/m256_train.log; tail -n 2 /tmp/m256/log.jsonl 2>/dev/null
cp /tmp/m256_train.log $OUT/ 2>/dev/null
el "sample 4 x 16"
for k in 0 16 32 48; do timeout -k 5 185 python3 .gpu/sample_part.py /tmp/m256 /tmp/m256png $k 16 > /tmp/sample_$k.log 2>&1 & done
wait $(jobs -p | grep -v "^$PT$") 2>/dev/null; sleep 1
cat /tmp/sample_*.log | grep -v "it/s\|tok/s" | tail -12
el "pytest"
wait $PT; echo "pytest rc=$?"; tail -n 30 $OUT/pytest_gpu.log
C=$(cat /tmp/m256/checkpoints/LATEST 2>/dev/null)
tar -C /tmp -czf /tmp/ckpt.tgz m256/config.json m256/log.jsonl m256/checkpoints/LATEST m256/checkpoints/$C/config.json m256/checkpoints/$C/manifest.json m256/checkpoints/$C/model.safetensors && split -b 15M /tmp/ckpt.tgz $OUT/ckpt.tgz.
tar -C /tmp -cf $OUT/m256_samples.tar m256png sample_0.log sample_16.log sample_32.log sample_48.log 2>/dev/null
ls -la $OUT; el "done"
