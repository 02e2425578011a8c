bash scripts/gpu-session.sh tests
export PYTHONPATH=/tmp/site
for opt in "" "tunable_op_enable=1,tunable_op_tuning_enable=1"; do
  echo "## options: $opt"
  python3 benchmarks/models.py --models bert_base,gpt2 --fp16 --no-torch --runs 100 --cuda-options "$opt" --out /tmp/onnxplug_models > $OUT/m_$([ -z "$opt" ] && echo off || echo on).log 2>&1
  grep -E "^\| (bert_base|gpt2) \|" $OUT/m_$([ -z "$opt" ] && echo off || echo on).log
done
