# Registers and occupancy per k-quant format and row path, bf16/fp16 rows: python compare.py BEFORE.json AFTER.json
import json,collections,sys
def agg(f):
    d=json.load(open(f)); a=collections.defaultdict(list)
    for r in d['records']:
        if r['kernel'] not in ('_kquant_gemv_kernel','_quant_gemv_kernel') or r['dtype']=='fp32': continue
        fmt=r['example'].split()[2]
        if r['kernel']=='_quant_gemv_kernel' and fmt!='q4_1': continue
        path='dot' if 'USE_DOT=True' in r['config'] else 'M=1'
        a[(fmt,path)].append((r['registers'],r['occupancy']))
    return a
old,new=agg(sys.argv[1]),agg(sys.argv[2])
print("| format | path | registers before | after | occupancy before | after |")
for k in sorted(new):
    o,n=old.get(k,[(0,0)]),new[k]
    rg=lambda v: f"{min(x[0] for x in v)}-{max(x[0] for x in v)}"
    oc=lambda v: f"{min(x[1] for x in v):.2f}-{max(x[1] for x in v):.2f}"
    print(f"| {k[0]} | {k[1]} | {rg(o)} | {rg(n)} | {oc(o)} | {oc(n)} |")
