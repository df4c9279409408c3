#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  int C=atoi(argv[1]), S=atoi(argv[2]), N=atoi(argv[3]), pf=atoi(argv[4]), B=atoi(argv[5]);
  size_t tot=(size_t)N*C*S; float*a=aligned_alloc(64,tot*4); for(size_t i=0;i<tot;i++)a[i]=1;
  __m512 acc=_mm512_setzero_ps(); double best=1e9;
  for(int rep=0;rep<10;rep++){ double t0=now();
  for(int n=0;n<N;n++) for(int p=0;p<S;p+=B){
     const float*base=a+(size_t)n*C*S+p;
     for(int c=0;c<C;c++){ const float*r=base+(size_t)c*S;
       if(pf && p+B<S) for(int l=0;l<B;l+=16) __builtin_prefetch(r+B*pf+l,0,pf>0?3:3);
       for(int v=0;v<B&&p+v<S;v+=16) acc=_mm512_add_ps(acc,_mm512_loadu_ps(r+v)); }
  }
  double dt=now()-t0; if(dt<best)best=dt;}
  printf("C=%d S=%d N=%d pf=%d B=%d: %.2f GB/s (%f)\n",C,S,N,pf,B,tot*4/best/1e9,_mm512_reduce_add_ps(acc));
}
