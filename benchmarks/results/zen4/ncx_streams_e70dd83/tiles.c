#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
/* out[6][64] += w[c][6] * in[c][64] over C channels, 11 channel blocks per pixel block (like 256->64) */
int main(int argc,char**argv){
  int C=atoi(argv[1]), S=atoi(argv[2]), N=atoi(argv[3]), pf=atoi(argv[4]), NB=atoi(argv[5]);
  size_t tot=(size_t)N*C*S; float*a=aligned_alloc(64,tot*4); for(size_t i=0;i<tot;i++)a[i]=1e-3f;
  float*w=aligned_alloc(64,(size_t)C*6*NB*4); for(int i=0;i<C*6*NB;i++)w[i]=1e-3f;
  float*o=aligned_alloc(64,(size_t)N*NB*6*S*4); for(size_t i=0;i<(size_t)N*NB*6*S;i++)o[i]=0;
  double best=1e9;
  for(int rep=0;rep<5;rep++){ double t0=now();
  for(int n=0;n<N;n++) for(int p=0;p+64<=S;p+=64){
     const float*base=a+(size_t)n*C*S+p;
     for(int cb=0;cb<NB;cb++){
       __m512 acc[6][4]; for(int r=0;r<6;r++)for(int v=0;v<4;v++)acc[r][v]=_mm512_setzero_ps();
       const float*wc=w+(size_t)cb*C*6;
       int c0=C*cb/NB, c1=C*(cb+1)/NB;
       if(pf) for(int c=c0;c<c1;c++) for(int l=0;l<64;l+=16) __builtin_prefetch(base+(size_t)c*S+64+l,0,3);
       if(pf>=2 && p+64<S) for(int r=0;r<6;r++) for(int l=0;l<64;l+=16) __builtin_prefetch(o+((size_t)n*NB*6+cb*6+r)*S+p+64+l,1,2);
       for(int c=0;c<C;c++){ const float*r=base+(size_t)c*S;
         __m512 d0=_mm512_load_ps(r),d1=_mm512_load_ps(r+16),d2=_mm512_load_ps(r+32),d3=_mm512_load_ps(r+48);
         for(int k=0;k<6;k++){__m512 b=_mm512_set1_ps(wc[c*6+k]);
           acc[k][0]=_mm512_fmadd_ps(d0,b,acc[k][0]);acc[k][1]=_mm512_fmadd_ps(d1,b,acc[k][1]);
           acc[k][2]=_mm512_fmadd_ps(d2,b,acc[k][2]);acc[k][3]=_mm512_fmadd_ps(d3,b,acc[k][3]);}
       }
       for(int r=0;r<6;r++)for(int v=0;v<4;v++)_mm512_store_ps(o+((size_t)n*NB*6+cb*6+r)*S+p+v*16,acc[r][v]);
     }
  }
  double dt=now()-t0; if(dt<best)best=dt;}
  double fl=2.0*N*(S/64*64)*C*6*NB;
  printf("C=%d S=%d N=%d pf=%d NB=%d: %.1f GFLOP/s, input %.2f GB/s\n",C,S,N,pf,NB,fl/best/1e9,tot*4/best/1e9);
}
