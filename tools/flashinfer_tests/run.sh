# FlashInfer's own RoPE tests of apply_rope_with_cos_sin_cache(_inplace) against ropekv: the eager
# functions, then ropekv.torch's custom ops
set -u
rc=0
for form in eager torch; do
  echo "== ropekv form: $form"
  ROPEKV_PEER_FORM=$form python3 -m pytest -q -p no:cacheprovider tests/attention/test_rope.py -k test_rope_cos_sin_cache -rs 2>&1 | tail -5 || rc=1
done
exit $rc
