import json, sys, statistics as st, collections
L = json.load(open(sys.argv[1]))[160:]
prev=None; streak=0; rows=collections.defaultdict(list)
for c in L:
    streak = streak+1 if c['arm']==prev else 0; prev=c['arm']
    if c['measured'] and c['key']==0:
        rows[(c['arm'], 's0' if streak==0 else 's1' if streak==1 else 's2+')].append(c)
for k in sorted(rows):
    v=rows[k]; s=[c['s']-c['pre'] for c in v]; t=[c['tokens'] for c in v]
    print(k, len(v), "ms %.1f med %.1f tok %.2f tok/s %.1f" % (1e3*st.mean(s), 1e3*st.median(s), st.mean(t), sum(t)/sum(s)))
print(collections.Counter(c['arm'] for c in L))
